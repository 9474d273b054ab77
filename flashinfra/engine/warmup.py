"""Start-up warm-up: capture every decode CUDA graph and compile the prefill kernels before serving.

Without it the first step at a new shape pays for Triton compilation (kernels specialise on the shapes and
integer arguments they first meet) and for a graph capture, so that step runs seconds instead of
milliseconds. ``warm_up`` captures the graphs of every (batch bucket, block-table width bucket) the
configuration can reach (``cuda_graphs.graph_keys``) and runs a few prefill-shaped forward passes at the
token budget (``prefill_shapes``), so kernels compile here and not in the middle of serving. With speculative
decoding the same (batch, width) pairs are captured again for the verify steps (``k + 1`` tokens per row, every
row padded to that), for the MTP layer's draft, its catch-up and chained steps (``engine/draft_graphs.py``) and for
the fold of each batch bucket; the eager paths of speculation run once too: the MTP layer's catch-up after each
prompt shape, and a prompt sharing its step with verify rows (``_mixed_verify_steps``).

The prefill passes write into the first cache blocks and KDA slots (and, with prefix caching, the first
checkpoint slot; with speculation, the first slots' ReplaySSM rings and the MTP layer's first blocks), which is
harmless before any request exists: a sequence starting at context 0 never reads its slot's old state, and blocks
and ring entries are written before they are read. On a CPU (no graphs, reference kernels) there is nothing to
warm and ``warm_up`` returns at once. What it leaves out: the vision tower warms up on first use.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from flashinfra.engine.cuda_graphs import graph_keys
from flashinfra.kernels.dispatch import deterministic
from flashinfra.model.forward_batch import ForwardBatch

logger = logging.getLogger("flashinfra.engine")

# Decode rows mixed into a prefill warm-up step (a chunked prefill sharing its step with decodes).
_MIXED_DECODE_ROWS = 3
# A short prompt, of an odd length, for the specialisations of a length that no power of two divides.
_SHORT_PROMPT = 17
# A step of this many prompts of (at most) this many tokens each, for the specialisations of a sequence count
# divisible by 16.
_MANY_PROMPTS = 16
_MANY_PROMPT_TOKENS = 64
# Decode rows beside a short prompt, few enough tokens a sequence that the indexer scores one query a program (a
# loaded server's steps: an H100 compiled that variant on the first 128-prompt burst after the warm-up).
_MANY_DECODE_ROWS = 31
# The shortest of the power-of-two prompts.
_SMALLEST_POWER = 16


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    graphs_captured: int
    prefill_shapes: tuple[tuple[int, ...], ...]
    memory_bytes: int  # device memory held after the warm-up that was not held before (graph pools)
    peak_bytes: int  # peak device memory allocated during the warm-up
    index_selects: int = 0  # runs of the indexer's top-k selects beside the prompts' (``index_selects``)

    def line(self) -> str:
        return (f"warm-up: {self.graphs_captured} CUDA graphs, {len(self.prefill_shapes)} prefill shapes and "
                f"{self.index_selects} index selects "
                f"in {self.seconds:.1f} s; {self.memory_bytes / 2**20:.0f} MiB held, "
                f"peak {self.peak_bytes / 2**30:.2f} GiB")


def prefill_shapes(budget: int, max_model_len: int, max_num_seqs: int, block_size: int,
                   num_blocks: int) -> list[list[int]]:
    """Query lengths of the prefill warm-up steps (one list per step; a ``1`` is a decode row): the whole
    token budget as one prompt, a budget step shared with decode rows, a short odd-length prompt, a prompt of each
    power-of-two length below the budget and one of a token less, 16 short prompts together, and a short prompt
    among some 30 decode rows.
    Each step fits the context length, the sequence count and the cache blocks."""
    longest = min(budget, max_model_len - 1, num_blocks * block_size)
    shapes = [[longest]]
    rows = min(_MIXED_DECODE_ROWS, max_num_seqs - 1, longest - 2)
    while rows > 0 and -(-(longest - 1 - rows) // block_size) + rows > num_blocks:  # one block per decode row
        rows -= 1
    if rows > 0:
        shapes.append([longest - 1 - rows] + [1] * rows)  # an odd total beside the budget's
    short = min(_SHORT_PROMPT, longest)
    if short not in (s[0] for s in shapes):
        shapes.append([short])
    # a prompt of each power-of-two length below the budget, and one token shorter: kernels choose tile sizes and
    # split factors by the step's token count or context (the mHC mix's split, the indexer's top-k block, the fused
    # MoE's tiles), in power-of-two classes, and within each class Triton specialises a count on its divisibility by
    # 16 (an H100 compiled the MoE GEMMs after start-up for a 16-token prompt tail after a prefix hit, and for 16 such
    # tails of a length no 16 divides)
    length = _SMALLEST_POWER
    while length < longest:
        shapes.extend([[length - 1], [length]] if length - 1 != short else [[length]])
        length *= 2
    # many prompts at once: Triton specialises an integer argument on its divisibility by 16, so a step of 16
    # sequences compiles variants that 1 or 4 sequences never meet (an H100 saw a first 32-prompt step at 18x its
    # steady time after the warm-up without it)
    per = min(_MANY_PROMPT_TOKENS, longest // _MANY_PROMPTS, max_model_len - 1)
    if max_num_seqs >= _MANY_PROMPTS and per >= 1 and _MANY_PROMPTS * -(-per // block_size) <= num_blocks:
        shapes.append([per] * _MANY_PROMPTS)
    # a short prompt among many decode rows (fewer than dsa_indexer.SHARED_KEYS_MIN_QUERIES tokens a sequence), with
    # a token count 16 does not divide and one it does
    many = min(_MANY_DECODE_ROWS, max_num_seqs - 1)
    for rows in (many - 1, many):
        if rows >= _MANY_PROMPTS and short + rows <= longest and -(-short // block_size) + rows <= num_blocks:
            shapes.append([short] + [1] * rows)
    return shapes


def _passes(shapes: list[list[int]], checkpoint_slot: int | None):
    """Each shape without prefix checkpoints, then (with ``checkpoint_slot``) with one halfway through its first
    prompt, as a step crossing a checkpoint position has it (``ForwardBatch.checkpoints``)."""
    for query_lens in shapes:
        yield query_lens, ()
    if checkpoint_slot is not None:
        for query_lens in shapes:
            if query_lens[0] > 1:
                yield query_lens, ((0, query_lens[0] // 2, checkpoint_slot),)


# Verify rows beside a prompt in the speculative warm-up's mixed steps: one, a few, and a multiple of 16 (the sizes
# Triton specialises an integer argument on).
_MIXED_VERIFY_ROWS = (1, 3, 16)


def _prefill_batch(query_lens: list[int], block_size: int, device, verify: int = 0) -> ForwardBatch:
    """Prompts start at context 0; decode rows, and the last ``verify`` rows (verify rows of a speculative step,
    ``replay``), have one token in the cache. Blocks are handed out in order."""
    B = len(query_lens)
    context_lens = [0 if q > 1 and b < B - verify else 1 for b, q in enumerate(query_lens)]
    tables, next_block = [], 0
    for q, c in zip(query_lens, context_lens):
        n = -(-(q + c) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    batch = ForwardBatch.build(query_lens, context_lens, list(range(B)), tables, block_size, device)
    return dataclasses.replace(batch, replay=tuple(b >= B - verify for b in range(B))) if verify else batch


def _mixed_verify_steps(runner, longest: int, max_num_seqs: int, num_blocks: int):
    """The query lengths of eager speculative steps: a prompt sharing its step with ``_MIXED_VERIFY_ROWS`` verify
    rows of ``k + 1`` tokens each, as ``(query_lens, verify rows)``, the whole within ``longest`` tokens."""
    k = runner.speculator.num_tokens
    for rows in _MIXED_VERIFY_ROWS:
        prompt = longest - rows * (k + 1)
        if rows < max_num_seqs and prompt > 1 and -(-prompt // runner.block_size) + rows <= num_blocks:
            yield [prompt] + [k + 1] * rows, rows


def capture_graphs(runner, max_num_seqs: int, max_model_len: int, num_blocks: int) -> int:
    """Capture the graphs of every (batch bucket, width bucket) this configuration can reach: a decode graph each,
    with speculative decoding a verify graph (``k + 1`` tokens per row) and a draft-chain graph (``k > 1``) each too,
    and a fold graph per batch bucket; returns how many were new."""
    graphs = runner.graphs
    if graphs is None:
        return 0
    pairs = graph_keys(max_num_seqs, -(-max_model_len // runner.block_size), num_blocks, graphs.batch_buckets)
    captured = graphs.capture([(b, w, q) for q in graphs.step_qs for b, w in pairs])
    spec = runner.speculator
    if spec is not None and spec.graphs is not None:
        captured += spec.graphs.capture(pairs) + spec.overlap.capture(graphs)
    if spec is not None and spec.fold_graphs is not None:
        captured += spec.fold_graphs.capture(sorted({b for b, _ in pairs}))
    return captured


def index_selects(cfg, max_model_len: int, block_size: int, budget: int, device) -> int:
    """The DSA indexer's top-k over rows that the warm-up prompts do not make: the sort's widths that only many
    prompts at once reach, and rows longer than any warm-up prompt (contexts of 64k tokens and more), compiled here
    rather than in a server's first bursts or midway through a long prompt. -> the runs."""
    if not cfg.indexer_layers:
        return 0
    from flashinfra.kernels.dsa_topk import THRESHOLD_MIN_POOLS, warm_up_sort, warm_up_threshold

    kpool, k = cfg.index_kpool, cfg.index_topk // cfg.index_kpool
    runs = warm_up_sort(budget, k, device)
    max_pools = -(-max_model_len // block_size) * (block_size // kpool)  # the widest block table's pools
    if max_pools >= THRESHOLD_MIN_POOLS:
        runs += warm_up_threshold(max_pools, k, kpool, device)
    return runs


def warm_up(runner, max_num_seqs: int, max_model_len: int, budget: int, num_blocks: int,
            checkpoint_slot: int | None = None) -> WarmupReport | None:
    """Capture the decode (and verify and draft) graphs, compile the prefill kernels of this configuration and run the
    logits of every row count up to ``max_num_seqs`` (CUDA only). ``checkpoint_slot``: a prefix checkpoint slot
    (prefix caching on), so that each prefill shape runs a second time with a checkpoint inside its first prompt: the
    kernels that write one compile other variants."""
    device = runner.device
    if device.type != "cuda":
        return None
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    held_before = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    shapes = prefill_shapes(budget, max_model_len, max_num_seqs, runner.block_size, num_blocks)
    model = runner.model
    # in the runner's mode: a graph captured here is what its decode steps replay (deterministic kernels or not)
    spec = runner.speculator
    with torch.inference_mode(), deterministic(runner.deterministic):
        for query_lens, inside in _passes(shapes, checkpoint_slot):
            batch = dataclasses.replace(_prefill_batch(query_lens, runner.block_size, device), checkpoints=inside)
            input_ids = torch.zeros(sum(query_lens), dtype=torch.long, device=device)
            hidden = model.forward(input_ids, batch, runner.cache)
            last = torch.tensor(batch.last_token_indices, dtype=torch.long, device=device)
            model.compute_logits(hidden[last])
            if spec is not None and not inside:  # the MTP layer's catch-up after these prompts: eager, as long
                spec.mtp(model.model.embed_tokens[input_ids], hidden, batch, spec.mtp_cache)
        if spec is not None:
            for query_lens, verify in _mixed_verify_steps(runner, shapes[0][0], max_num_seqs, num_blocks):
                batch = _prefill_batch(query_lens, runner.block_size, device, verify)
                model.forward(torch.zeros(sum(query_lens), dtype=torch.long, device=device), batch, runner.cache)
        # the logits of every row count a step can sample (outside the graphs): a loaded server's mixed steps met a
        # new count almost every step, and cuBLAS's first product of a count stalled the host 2-3 ms
        rows = torch.zeros(max_num_seqs, model.config.text.hidden_size, dtype=model.dtype, device=device)
        for n in range(1, max_num_seqs + 1):
            model.compute_logits(rows[:n])
        selects = index_selects(model.config.text, max_model_len, runner.block_size, budget, device)
        captured = capture_graphs(runner, max_num_seqs, max_model_len, num_blocks)
    torch.cuda.synchronize(device)
    report = WarmupReport(seconds=time.perf_counter() - start, graphs_captured=captured,
                          prefill_shapes=tuple(tuple(s) for s in shapes), index_selects=selects,
                          memory_bytes=max(0, torch.cuda.memory_reserved(device) - held_before),
                          peak_bytes=torch.cuda.max_memory_allocated(device))
    logger.info(report.line())
    return report
