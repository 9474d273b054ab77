"""Perplexity of a model on a token stream, computed through the engine's model path.

Owns: cutting a token stream into windows, packing windows into batches of at most ``max_batch_tokens``
tokens (one ``ForwardBatch`` per batch, every window a fresh sequence with its own cache blocks and KDA
slot), and summing the negative log-likelihood of every scored token. Leaves tokenizing and the command
line to ``cli.py``.

Counting: token 0 of the stream has no context and is never scored; every other token is scored exactly
once. Window ``i`` covers ``[i * stride, i * stride + window)`` and scores only the tokens that no earlier
window scored, the rest being its context. The default stride, ``window - 1``, overlaps consecutive
windows by one token, so that no token is lost as a context-free window start. Perplexity is
``exp(sum of NLL / number of scored tokens)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.progress import progress_bar


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the stream
    end: int  # one past its last token
    first_scored: int  # first token (stream index) whose NLL this window contributes

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


@dataclass(frozen=True)
class PerplexityResult:
    tokens_scored: int
    nll_sum: float
    windows: int
    window: int
    stride: int
    elapsed_s: float

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_nll": self.mean_nll, "perplexity": self.perplexity}


def make_windows(num_tokens: int, window: int, stride: int | None = None) -> list[Window]:
    """Windows over ``num_tokens`` tokens such that tokens ``1 .. num_tokens - 1`` are each scored once."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    stride = window - 1 if stride is None else stride
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must lie in [1, window - 1 = {window - 1}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {num_tokens}")
    windows: list[Window] = []
    scored_up_to = 1  # next stream index that still needs a score
    start = 0
    while scored_up_to < num_tokens:
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, max(scored_up_to, start + 1)))
        scored_up_to = end
        start += stride
    return windows


def pack_windows(windows: list[Window], max_batch_tokens: int) -> list[list[Window]]:
    """Consecutive windows grouped so that each group holds at most ``max_batch_tokens`` tokens."""
    if windows and max(w.length for w in windows) > max_batch_tokens:
        raise ValueError(f"max_batch_tokens ({max_batch_tokens}) is smaller than one window")
    batches: list[list[Window]] = []
    size = 0
    for w in windows:
        if batches and size + w.length <= max_batch_tokens:
            batches[-1].append(w)
            size += w.length
        else:
            batches.append([w])
            size = w.length
    return batches


@torch.no_grad()
def batch_nll(model, ids: torch.Tensor, windows: list[Window], block_size: int, logits_rows: int) -> float:
    """Sum of NLL over the scored tokens of ``windows``, all run as one packed prefill."""
    device = model.device
    tables: list[list[int]] = []
    next_block = 0
    for w in windows:
        n = -(-w.length // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    cache = model.allocate_cache(next_block, block_size, len(windows))
    batch = ForwardBatch.build(
        [w.length for w in windows], [0] * len(windows), list(range(len(windows))), tables, block_size, device
    )
    tokens = torch.cat([ids[w.start : w.end] for w in windows]).to(device)
    hidden = model.forward(tokens, batch, cache)  # [T, D]
    # Row r of the packed axis predicts the stream token after it; keep the rows whose target is scored.
    rows, targets = [], []
    offset = 0
    for w in windows:
        first_row = offset + (w.first_scored - 1 - w.start)
        rows.append(torch.arange(first_row, offset + w.length - 1))
        targets.append(ids[w.first_scored : w.end])
        offset += w.length
    rows_t = torch.cat(rows).to(device)
    targets_t = torch.cat(targets).to(device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(0, len(rows_t), logits_rows):
        logits = model.compute_logits(hidden[rows_t[i : i + logits_rows]])  # [n, vocab] float32
        nll = torch.nn.functional.cross_entropy(logits, targets_t[i : i + logits_rows], reduction="sum")
        total += nll.double()
    return float(total)


def perplexity(
    model,
    token_ids: list[int] | torch.Tensor,
    window: int = 512,
    stride: int | None = None,
    max_batch_tokens: int = 4096,
    block_size: int = 16,
    logits_rows: int = 1024,
    progress: bool | None = None,
) -> PerplexityResult:
    """Perplexity of ``model`` (a ``flashinfra.load_model`` result) on ``token_ids``; ``progress``: a bar on
    stderr over the scored tokens (``None``: when stderr is a terminal)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    vocab = model.config.text.vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab})")
    windows = make_windows(ids.numel(), window, stride)
    start = time.perf_counter()
    nll = 0.0
    bar = progress_bar(sum(w.num_scored for w in windows), "perplexity", "tok", progress)
    for group in pack_windows(windows, max_batch_tokens):
        nll += batch_nll(model, ids, group, block_size, logits_rows)
        bar.update(sum(w.num_scored for w in group))
    bar.close()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    scored = sum(w.num_scored for w in windows)
    return PerplexityResult(
        tokens_scored=scored,
        nll_sum=nll,
        windows=len(windows),
        window=window,
        stride=window - 1 if stride is None else stride,
        elapsed_s=time.perf_counter() - start,
    )
