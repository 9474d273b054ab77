"""The overlapped speculative step: acceptance, fold and draft launched on the device before the host reads a token.

In the plain speculative step (``Speculator.accept_rows``, ``fold``, ``draft``) the host reads the target's tokens
back after the verify, accepts, and only then launches the fold and the MTP layer's draft: the device waits for the
host in between. When every row of a verify step is greedy (no penalties, logprobs or grammar), has drafted before
(its last hidden kept, none deferred) and the draft runs from graphs, all of it can go to the device at once:

- acceptance: the argmax at every fed position, compared with the drafts in the step's own input tokens (where the
  device put them): each row commits ``m = 1 + (drafts equal to the argmax before them)`` of its fed tokens;
- the fold of those ``m`` into every KDA checkpoint (``FoldGraphs`` reads the counts from the device);
- the catch-up over all ``1 + n`` entries a row can commit (``n`` fed tokens: the previous step's last position, then
  each fed position with the argmax after it as its token, which is the committed token wherever it counts). The
  entries past a row's ``m``-th are its rejected positions: causal to the real ones, so they change nothing, and
  overwritten by the chain or the next catch-up before anything reads them (``CatchupBuffers.fill``, ``ends``); the
  chain starts from the ``m``-th, at position ``context + m`` (``chain_inputs``, on the device).

The argmax comes back in a copy whose event is recorded before the fold and the draft, so the host waits for the
verify only, and files the step's tokens (``greedy_accept`` on the same argmax and drafts gives the device's ``m``)
while the device folds and drafts. The step's emitted tokens are what the plain step emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.engine.draft_graphs import chain_steps
from flashinfra.engine.sched.plan import ScheduledRequest, StepResult
from flashinfra.engine.spec_accept import greedy_accept
from flashinfra.model.forward_batch import ForwardBatch


@dataclass
class PendingAccept:
    """An overlapped step launched: its rows with their fed tokens, and the argmax at every fed position on its
    way to the host (``copied``: its event; None on a CPU)."""

    rows: list[tuple[ScheduledRequest, list[int]]]
    cu: list[int]
    targets: torch.Tensor
    copied: torch.cuda.Event | None


class OverlappedStep:
    def __init__(self, spec) -> None:
        self.spec = spec
        self._pinned = torch.empty(0, dtype=torch.long)

    def can_run(self, sched: list[ScheduledRequest], feeds: list[list[int]], replay: tuple[bool, ...]) -> bool:
        """Whether this verify step can run overlapped (see the module's docstring)."""
        s = self.spec
        if (s.graphs is None or s.fold_graphs is None or not replay or not all(replay)
                or not s.graphs.can_run(len(sched)) or not s.fold_graphs.can_run(len(sched))
                or 0 < s.max_batch < len(sched)):
            return False
        for sr, f in zip(sched, feeds):
            p = sr.sampling
            if (not sr.sample or not p.greedy or p.has_penalties or p.logprobs is not None or p.grammar is not None
                    or sr.num_new_tokens != 1 or sr.context_len == 0 or sr.request_id not in s.hidden
                    or sr.request_id in s.deferred or len(f) > s.num_tokens + 1):
                return False
        return True

    def launch(self, sched: list[ScheduledRequest], feeds: list[list[int]], cu: list[int], hidden: torch.Tensor,
               input_ids: torch.Tensor) -> PendingAccept:
        """Accept, fold and draft on the device for a verify step (``can_run``): ``hidden`` [T, D] and ``input_ids``
        [T] its fed positions' hidden states and tokens in ``cu``'s packing."""
        s = self.spec
        s.resolve(sched, feeds)  # the previous drafts' copy is over: its pinned buffer takes this step's
        k, B, T, bsz = s.num_tokens, len(sched), cu[-1], s.block_size
        ns = [len(f) for f in feeds]
        ctxs = [sr.context_len for sr in sched]
        tables = [list(sr.block_table) for sr in sched]
        slots = [sr.state_slot for sr in sched]
        # row b's argmax at its fed positions (the last repeated) and its drafts (where absent, masked)
        tgt = [cu[b] + min(j, ns[b] - 1) for b in range(B) for j in range(k + 1)]
        drf = [cu[b] + min(1 + j, ns[b] - 1) for b in range(B) for j in range(k)]
        # the catch-up's 1 + n entries per row, from [argmax at the T positions, the rows' fed tokens] and
        # [the T hidden states, the rows' last hiddens]
        gather = [i for b in range(B) for i in (T + b, *range(cu[b], cu[b] + ns[b]))]
        qlens = [n + 1 for n in ns]
        i32, i64 = torch.int32, torch.int64
        arrays = ForwardBatch.host_arrays(qlens, [c - 1 for c in ctxs], slots, tables, bsz)
        views = s.staging.upload(arrays + [
            ("tgt", i64, tgt, (B, k + 1)), ("drf", i64, drf, (B, k)), ("ns", i64, ns, (B,)),
            ("gather", i64, gather, (len(gather),)), ("fed0", i64, [f[0] for f in feeds], (B,)),
            ("fold_slots", i32, slots, (B,)), ("starts", i64, cu[:-1], (B,)), ("ctxs", i64, ctxs, (B,))])
        targets = torch.argmax(s.model.compute_logits(hidden[:T]), -1)
        host, copied = targets, None
        if targets.is_cuda:
            if self._pinned.numel() < T:
                self._pinned = torch.empty(max(1024, T), dtype=torch.long, pin_memory=True)
            host = self._pinned[:T]
            host.copy_(targets, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        valid = torch.arange(k, device=targets.device)[None, :] < views["ns"][:, None] - 1  # the row's drafts
        eq = (targets[views["tgt"]][:, :k] == input_ids[views["drf"]]) & valid
        m = 1 + eq.long().cumprod(1).sum(1)  # the fed tokens each row commits
        s.fold_graphs.run(views["fold_slots"], m.int())
        prev = torch.stack([s.hidden[sr.request_id] for sr in sched])
        ids = torch.cat([targets, views["fed0"]])[views["gather"]]
        hid = torch.cat([hidden[:T], prev])[views["gather"]]
        batch = ForwardBatch.from_views(qlens, [c - 1 for c in ctxs], slots, tables, bsz, views)
        last = batch.cu_seqlens[:-1].long() + m  # each row's m-th entry
        out = s.graphs.run_catchup(ids, hid, batch, views["ctxs"] + m, tables, ends=last)
        s.keep_drafts(out)
        kept = hidden[views["starts"] + m - 1]  # each row's last committed position: the next catch-up's first
        s.hidden.update((sr.request_id, kept[b]) for b, sr in enumerate(sched))
        return PendingAccept([(sr, f) for sr, f in zip(sched, feeds)], cu, host, copied)

    def finish(self, p: PendingAccept, result: StepResult) -> None:
        """The step's tokens into ``result`` once the argmax is on the host; the kept drafts' rows filed."""
        s = self.spec
        if p.copied is not None:
            p.copied.synchronize()
        targets = p.targets.tolist()
        rows = []
        for b, (sr, fed) in enumerate(p.rows):
            drafts = fed[1:]
            out = s.count(greedy_accept(targets[p.cu[b] : p.cu[b + 1]], drafts), drafts) if drafts else [
                targets[p.cu[b]]]
            rid = sr.request_id
            if drafts or sr.num_draft:  # the scheduler reads a drafting row's tokens from ``emitted``
                result.emitted[rid] = out
            if not drafts:
                result.sampled[rid] = out[0]
            pos = sr.context_len + len(out)
            rows.append((rid, chain_steps([pos], [sr.block_table], s.num_tokens, s.block_size)[0]))
        s.file_drafts(rows)
