"""``ModelRunner``: executes a scheduler ``Plan`` on the model and returns a ``StepResult``.

It owns the cache tensors (``ModelCache``; state slots ``num_slots ..`` hold prefix checkpoints, copied
in before the forward pass, and written by the KDA layers inside it or copied out after it where a row's step
ends at one, as the plan says) and one ``torch.Generator`` per request that samples, kept
until the scheduler reports the request finished (so a request preempted and recomputed continues its
random stream where it stopped). It packs the plan into one ``ForwardBatch``, runs the model for the hidden
states of the positions where a next token is sampled only (a context-parallel model gathers no others), computes
their logits and samples them; requests with a grammar get their token bitmask filled on the CPU, started before the
forward pass is launched and waited for only when the logits are sampled (``flashinfra.engine.grammar``).
``size_cache`` turns a memory budget into a number of blocks and slots.

A step's integer inputs reach the device in one packed copy (``model/staging.py``). ``launch`` starts a step and
``finish`` waits for its tokens (``execute`` does both): between them the engine may launch the next step, whose
placeholder tokens (asynchronous scheduling) are gathered on the device from the samples of the step in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

import torch

from flashinfra.engine.block_tables import BlockTables
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.sched.plan import PLACEHOLDER_TOKEN, Plan, StepResult
from flashinfra.engine.spec_overlap import PendingAccept
from flashinfra.kernels import dispatch
from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.staging import HostStaging
from flashinfra.engine.cuda_graphs import DecodeGraphs, graphs_supported
from flashinfra.engine.penalties import PenaltyRows, PenaltyStep
from flashinfra.engine.sampler import DeviceSample, Fill, SamplingRow, sample, sample_batch, sampling_columns
from flashinfra.multimodal.encoder import encoder_reserve_bytes, make_embedder

CPU_DEFAULT_CACHE_BYTES = 256 * 2**20
GPU_CACHE_FRACTION = 0.85  # of the memory free after the model is loaded


def size_cache(model: LoadedModel, config: EngineConfig, max_model_len: int, per_block: int | None = None) -> int:
    """Number of paged blocks: ``num_blocks`` if given, else what the memory budget holds after the
    ``max_num_seqs`` KDA slots, capped at what ``max_num_seqs`` sequences of ``max_model_len`` could use;
    ``per_block``: the bytes of one block on this rank (default: every MLA layer's, as one GPU holds them)."""
    text = model.cache_text  # a tensor-parallel rank's slots hold its KDA heads only
    if per_block is None:
        per_block = ModelCache.bytes_per_block(text, config.block_size, model.dtype, model.latent_dtypes())
    per_slot = ModelCache.bytes_per_slot(text, model.dtype, model.cache_spec.state_dtype)
    num_slots = config.max_num_seqs + config.resolved_prefix_slots
    blocks_per_seq = -(-max_model_len // config.block_size)
    if config.num_blocks is not None:
        return config.num_blocks
    budget = config.kv_cache_memory
    if budget is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            reserve = encoder_reserve_bytes(model, config.encoder_cache_memory, bool(config.encoder_address))
            budget = int(free * GPU_CACHE_FRACTION) - reserve
        else:
            budget = CPU_DEFAULT_CACHE_BYTES
    left = budget - num_slots * per_slot
    if left < per_block:
        raise ValueError(
            f"a cache budget of {budget} bytes does not hold {num_slots} KDA state slots ({per_slot} bytes "
            f"each) and one block ({per_block} bytes); raise kv_cache_memory, lower max_num_seqs or prefix_cache_slots"
        )
    return max(1, min(left // max(per_block, 1), config.max_num_seqs * blocks_per_seq))


@dataclass
class StepHandle:
    """A launched step: its result so far (errors, tokens sampled on the host) and, when sampled on the device,
    the samples on their way to the host (``sampled``; ``rows``: each request's row in ``sampled.tokens``), or an
    overlapped speculative step's (``speculative``, ``engine/spec_overlap.py``)."""

    result: StepResult
    picks: list = field(default_factory=list)  # (ScheduledRequest, row of its hidden state)
    sampled: DeviceSample | None = None
    rows: dict[str, int] = field(default_factory=dict)
    speculative: PendingAccept | None = None  # an overlapped speculative step's tokens on their way


class ModelRunner:
    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, num_slots: int, seed: int = 0,
                 num_prefix_slots: int = 0, cuda_graphs: bool = True, encoder_cache_bytes: int = 256 * 2**20,
                 speculative_tokens: int = 0, deterministic: bool = False, remote_encoder: bool = False,
                 speculative_max_batch: int = 0) -> None:
        self.model = model
        self.deterministic = deterministic
        self.device = model.device
        self.block_size = block_size
        graphs = cuda_graphs and graphs_supported(model)
        # with graphs, one more block and slot that the scheduler never hands out: the padding rows' scratch
        self.cache = model.allocate_cache(num_blocks + graphs, block_size, num_slots + num_prefix_slots + graphs)
        self.graphs = (DecodeGraphs(model, self.cache, num_blocks, num_slots + num_prefix_slots,
                                    verify_q=speculative_tokens + 1) if graphs else None)
        self.staging = HostStaging(self.device)  # every step's integer inputs, one copy to the device
        self.block_tables = BlockTables()  # each running request's block table, kept as an array between steps
        self.generators: dict[str, torch.Generator] = {}
        self.penalties = PenaltyRows(model.config.text.vocab_size, self.device)
        self.grammars = None  # GrammarRuntime, made on the first request with a grammar
        self._seeds = random.Random(seed)
        self.shared_generator = torch.Generator(device=self.device)  # the unseeded sampled rows' (``_row_generator``)
        self.shared_generator.manual_seed(self._seeds.getrandbits(63))
        # None unless the vision tower is loaded or an encode engine (``remote_encoder``) makes the embeddings
        self.embedder = make_embedder(model, encoder_cache_bytes, remote_encoder)
        self.speculator = None
        if speculative_tokens:
            from flashinfra.engine.speculative import Speculator

            self.speculator = Speculator(model, self.cache, speculative_tokens, block_size, self.graphs,
                                          speculative_max_batch)

    def cache_footprint(self) -> dict[str, int]:
        """What the caches hold (``EngineReady``'s figures): every cache tensor's bytes, a cached token's bytes over
        every layer, and a sequence slot's state bytes (with speculation the MTP layer's entries, the ReplaySSM
        rings and the last hidden states too)."""
        caches = [self.cache] if self.speculator is None else [self.cache, self.speculator.mtp_cache]
        paged, slots = (sum(part) for part in zip(*(c.held_bytes() for c in caches)))
        if self.speculator is not None:
            slots += self.speculator.hidden.rows.nbytes
        return dict(cache_bytes=paged + slots, cache_bytes_per_token=paged // (self.cache.num_blocks * self.block_size),
                    state_bytes_per_seq=slots // self.cache.num_slots)

    def _row_generator(self, sr) -> torch.Generator | None:
        """A sampled row's generator of its own: a seeded request's (its stream is the seed's alone), or in
        deterministic mode any non-greedy row's (its tokens must not depend on the batch); other non-greedy rows
        draw from ``shared_generator`` together, one launch a step (``sampler._draw``)."""
        if sr.sampling.greedy or (sr.sampling.seed is None and not self.deterministic):
            return None
        return self._generator(sr.request_id, sr.sampling.seed)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        g = self.generators.get(request_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed if seed is not None else self._seeds.getrandbits(63))
            self.generators[request_id] = g
        return g

    def _copy_states(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KDA conv and recurrent states from slots ``src`` [N] to slots ``dst`` [N]."""
        if not src.numel():
            return
        for states in (self.cache.conv_state, self.cache.recurrent_state):
            for t in states.values():
                t[dst] = t[src]

    @torch.inference_mode()
    def execute(self, plan: Plan) -> StepResult:
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: Plan, prev: StepHandle | None = None) -> StepHandle:
        """Start the step on the device; its sampled tokens are copied to the host without waiting. ``prev``: the
        step still in flight, whose sampled tokens are the inputs of this plan's placeholder tokens."""
        with dispatch.deterministic(self.deterministic):
            return self._launch(plan, prev)

    def finish(self, handle: StepHandle) -> StepResult:
        """Wait for a launched step's samples; its ``StepResult``."""
        if handle.sampled is not None:
            tokens, logprobs, errors = handle.sampled.result()
            self._record(handle.picks, tokens, logprobs, errors, handle.result)
            handle.sampled = None
        if handle.speculative is not None:
            self.speculator.overlap.finish(handle.speculative, handle.result)
            handle.speculative = None
        return handle.result

    def _launch(self, plan: Plan, prev: StepHandle | None) -> StepHandle:
        spec = self.speculator
        for rid in plan.finished_ids:
            self.generators.pop(rid, None)
        self.penalties.release((*plan.finished_ids, *plan.preempted_ids))
        self.block_tables.drop((*plan.finished_ids, *plan.preempted_ids))
        if self.grammars is not None:
            self.grammars.release(plan.finished_ids)
        if spec is not None:
            for rid in (*plan.finished_ids, *plan.preempted_ids):
                spec.drop(rid)
        result = StepResult()
        if plan.is_empty:
            return StepHandle(result)
        sched = plan.scheduled
        # the fill runs on its own thread while this one prepares and launches the step
        grammar = self._grammar_mask([sr for sr in sched if sr.sample]) if spec is None else None
        if spec is not None:
            feeds, replay, fill = spec.feeds(sched)
        else:
            feeds, replay, fill = [sr.token_ids for sr in sched], (), self._placeholders(sched, prev)
        # penalties from the counts on the device, except where ``sample`` or the speculator samples on the host
        batch, inputs = self._upload(sched, feeds, fill, penalties=grammar is None and spec is None)
        if replay:
            batch = dataclasses.replace(batch, replay=replay)
        inside = tuple((b, pos - sr.context_len, slot) for b, sr in enumerate(sched) for pos, slot in sr.save_states
                       if pos < sr.context_len + sr.num_new_tokens)
        if inside:
            batch = dataclasses.replace(batch, checkpoints=inside)
        input_ids = inputs["input_ids"]
        self._copy_states(inputs["load_src"], inputs["load_dst"])
        embeds = self.embedder.embed(input_ids, sched) if self.embedder is not None else None
        # the rows whose logits are sampled: all a model computes for the step unless the speculator needs more
        picks = [(sr, i) for sr, i in zip(sched, batch.last_token_indices) if sr.sample]
        rows = None if spec is not None else inputs["rows"]
        replayed = None
        if embeds is not None:
            hidden = self.model.model(input_ids, batch, self.cache, inputs_embeds=embeds)
        elif self.graphs is not None and self.graphs.can_run(batch):
            if spec is not None:  # a verify graph's tail is captured while its inputs can be cleared
                spec.overlap.capture(self.graphs, [self.graphs.key(batch)])
            replayed = self.graphs.replay(input_ids, batch)
        else:
            hidden = self.model.forward(input_ids, batch, self.cache, rows=rows)
            rows = None  # already the picked rows
        if spec is not None and spec.overlap.can_run(sched, feeds, replayed):
            pending = spec.overlap.launch(sched, feeds, replayed, inputs["table_caps"])
            self._copy_states(inputs["save_src"], inputs["save_dst"])  # after the fold, on the stream
            return StepHandle(result, speculative=pending)
        if replayed is not None:
            hidden = replayed.hidden()
        if spec is not None:
            return StepHandle(self._finish_speculative(sched, feeds, replay, batch, hidden, result, inputs))
        self._copy_states(inputs["save_src"], inputs["save_dst"])
        return self._sample(picks, hidden if rows is None else hidden[rows], result, grammar, inputs)

    @staticmethod
    def _placeholders(sched, prev: StepHandle | None) -> Fill | None:
        """Where the placeholder tokens of asynchronous scheduling are filled from: ``prev``'s samples (a placeholder
        is the last token of its row, with one step in flight at most)."""
        ends = list(itertools.accumulate(len(sr.token_ids) for sr in sched))
        fill = [(e - 1, prev.rows[sr.request_id]) for sr, e in zip(sched, ends)
                if sr.token_ids[-1] == PLACEHOLDER_TOKEN]
        return (prev.sampled.tokens, fill) if fill else None

    def _upload(self, sched, feeds, fill: Fill | None,
                penalties: bool = False) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """The step's ``ForwardBatch`` and its other integer inputs (token ids, rows to sample, state copies, sampling
        parameters and, with ``penalties``, the ``PenaltyRows`` columns), all copied to the device in one packed copy;
        then the tokens still on the device (``fill``: a source and ``(position, index)`` pairs) gathered into the
        token ids."""
        qlens, ctxs = [len(f) for f in feeds], [sr.context_len for sr in sched]
        slots, tables = [sr.state_slot for sr in sched], [self.block_tables.table(sr) for sr in sched]
        arrays = ForwardBatch.host_arrays(qlens, ctxs, slots, tables, self.block_size)
        ids = [t for f in feeds for t in f]
        ends = list(itertools.accumulate(qlens))
        rows = [e - 1 for sr, e in zip(sched, ends) if sr.sample]
        pairs = fill[1] if fill is not None else []
        loads = [(sr.load_state_from, sr.state_slot) for sr in sched if sr.load_state_from is not None]
        # checkpoints at the end of their row's step: the row's final state, copied after the step (those inside
        # the step go to their slots through ``ForwardBatch.checkpoints``)
        saves = [(sr.state_slot, slot) for sr in sched for pos, slot in sr.save_states
                 if pos == sr.context_len + sr.num_new_tokens]
        i64 = torch.int64
        arrays += [("input_ids", i64, ids, (len(ids),)), ("rows", i64, rows, (len(rows),))]
        for name, copies in (("load", loads), ("save", saves)):
            arrays += [(f"{name}_src", i64, [p[0] for p in copies], (len(copies),)),
                       (f"{name}_dst", i64, [p[1] for p in copies], (len(copies),))]
        arrays += [("fill_pos", i64, [p for p, _ in pairs], (len(pairs),)),
                   ("fill_rows", i64, [r for _, r in pairs], (len(pairs),))]
        arrays += sampling_columns([sr.sampling for sr in sched if sr.sample])
        if self.speculator is not None:  # where each row's drafts must stop
            arrays.append(("table_caps", torch.int32, [len(t) * self.block_size for t in tables], (len(tables),)))
        if penalties:
            arrays += self.penalties.columns([sr for sr in sched if sr.sample])
        views = self.staging.upload(arrays)
        if pairs:
            views["input_ids"][views["fill_pos"]] = fill[0][views["fill_rows"]]
        return ForwardBatch.from_views(qlens, ctxs, slots, tables, self.block_size, views), views

    def _finish_speculative(self, sched, feeds, replay, batch: ForwardBatch, hidden, result: StepResult,
                            inputs: dict[str, torch.Tensor]) -> StepResult:
        """Accept the draft rows, sample the others, fold the committed tokens into the KDA checkpoints
        (before any checkpoint is copied out for the prefix cache), and draft for the next step."""
        spec, cu = self.speculator, batch.cu_seqlens_list
        spec.resolve(sched, feeds)
        committed = [len(f) for f in feeds]
        nexts: list[int | None] = [None] * len(sched)
        drafted = [b for b, sr in enumerate(sched) if len(feeds[b]) > sr.num_new_tokens]
        accepted = spec.accept_rows([(sched[b], feeds[b], cu[b], cu[b + 1]) for b in drafted], hidden,
                                    self._row_generator, self.shared_generator)
        for b, (out, lps) in zip(drafted, accepted):
            rid = sched[b].request_id
            result.emitted[rid] = out
            if lps is not None:
                result.emitted_logprobs[rid] = lps
            committed[b], nexts[b] = len(out), out[-1]
        plain = [(sr, cu[b + 1] - 1) for b, sr in enumerate(sched) if sr.sample and sr.request_id not in result.emitted]
        grammar = self._grammar_mask([sr for sr, _ in plain])
        if plain:
            rows = hidden[torch.tensor([i for _, i in plain], dtype=torch.long, device=self.device)]
            self.finish(self._sample(plain, rows, result, grammar))
        for b, sr in enumerate(sched):
            if sr.request_id in result.sampled:
                nexts[b] = result.sampled[sr.request_id]
                if sr.num_draft:  # the scheduler reads a drafting row's tokens from ``emitted``
                    result.emitted[sr.request_id] = [result.sampled[sr.request_id]]
                    if sr.request_id in result.logprobs:
                        result.emitted_logprobs[sr.request_id] = [result.logprobs[sr.request_id]]
        spec.fold(sched, replay, committed)
        self._copy_states(inputs["save_src"], inputs["save_dst"])
        spec.draft(sched, feeds, cu, hidden, committed, nexts)
        return result

    def _sample(self, picks, hidden, result: StepResult, grammar,
                columns: dict[str, torch.Tensor] | None = None) -> StepHandle:
        """Sample the ``picks`` (request, row) from ``hidden`` [len(picks), D], their rows' hidden states: on the
        device, unless a row has a grammar or its penalties are not in ``columns`` (then ``sample``, which reads its
        tokens back at once to retry failing rows alone). ``grammar``: the picks' ``GrammarMask`` (being filled) or
        None; ``columns``: the picks' ``sampling_columns`` and ``PenaltyRows`` columns, already on the device."""
        handle = StepHandle(result, picks)
        if not picks:
            return handle
        logits = self.model.compute_logits(hidden)
        rows = [
            SamplingRow(
                sr.sampling,
                sr.prompt_token_ids,
                sr.output_token_ids,
                self._row_generator(sr),
            )
            for sr, _ in picks
        ]
        penalties = None if columns is None else PenaltyStep.of(self.penalties, columns)
        if grammar is None and (penalties is not None or not any(sr.sampling.has_penalties for sr, _ in picks)):
            handle.sampled = sample_batch(logits, rows, columns=columns, penalties=penalties,
                                          shared=self.shared_generator).start_copy()
            handle.rows = {sr.request_id: i for i, (sr, _) in enumerate(picks)}
            return handle
        self._record(picks, *sample(logits, rows, grammar, self.shared_generator), result)
        return handle

    @staticmethod
    def _record(picks, tokens, logprobs, errors, result: StepResult) -> None:
        for (sr, _), tok, lp, err in zip(picks, tokens, logprobs, errors):
            if err is not None:
                result.errors[sr.request_id] = err
                continue
            result.sampled[sr.request_id] = tok
            if lp is not None:
                result.logprobs[sr.request_id] = lp

    def _grammar_mask(self, scheduled: list):
        """The ``GrammarMask`` of the rows ``scheduled`` sample, its fill started; None when no row has a grammar."""
        if self.grammars is None:
            if all(sr.sampling.grammar is None for sr in scheduled):
                return None
            from flashinfra.engine.grammar import GrammarRuntime

            text = self.model.config.text
            self.grammars = GrammarRuntime.for_model(self.model.path, text.vocab_size, text.eos_token_id, self.device)
        return self.grammars.prepare([(sr.request_id, sr.sampling.grammar, sr.output_token_ids) for sr in scheduled])
