"""The overlapped speculative step: acceptance, fold and draft replayed on the device before the host reads a token.

In the plain speculative step (``Speculator.accept_rows``, ``fold``, ``draft``) the host reads the target's tokens
back after the verify, accepts, and only then launches the fold and the MTP layer's draft: the device waits for the
host in between. When every row of a verify step is greedy (no penalties, logprobs or grammar), has drafted before
(its last hidden kept, none deferred) and the verify replays its graph, all of it runs from two more graphs per
verify graph (``VerifyTail``), which read the verify graph's static inputs and output where its replay left them:

- ``argmax``: the target's argmax at every fed position (the padded layout: row ``b``'s tokens at ``b * q``);
- ``body``: acceptance, each row committing ``m = 1 + (drafts equal to the argmax before them)`` of its fed tokens
  (a row's fed tokens are its entries whose cache slot is not the scratch one); the fold of those ``m`` into every
  KDA checkpoint; the MTP layer's catch-up over all ``1 + q`` entries a row can commit (the previous step's last
  position, with its kept hidden, then each fed position with the argmax after it as its token, which is the
  committed token wherever it counts), padded as ``CatchupBuffers`` pads; the entries past a row's ``m``-th are
  its rejected positions: causal to the real ones, so they change nothing, and overwritten by the chain or the next
  catch-up before anything reads them; the chain from the ``m``-th entry, at position ``context + m``; and each
  row's last committed hidden kept in its state slot's row (``LastHidden``).

The host's part of a step is the verify graph's fill and three replays. The argmax comes back in a copy whose event
is recorded before the body, so the host waits for the verify only and files the step's tokens (``greedy_accept``
on the same argmax and drafts gives the device's ``m``) while the device folds and drafts. The step's emitted
tokens are what the plain step emits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from flashinfra.engine.cuda_graphs import Replayed, StepBuffers
from flashinfra.engine.draft_graphs import CatchupBuffers, chain_steps, fold_layers
from flashinfra.engine.sched.plan import ScheduledRequest, StepResult
from flashinfra.engine.spec_accept import greedy_accept
from flashinfra.kernels.graph_inputs import fill_chain


@dataclass
class PendingAccept:
    """An overlapped step launched: its rows with their fed tokens, and the argmax at every position of its verify
    graph (``q`` a row) on its way to the host (``copied``: its event; None on a CPU)."""

    rows: list[tuple[ScheduledRequest, list[int]]]
    q: int
    targets: torch.Tensor
    copied: torch.cuda.Event | None


class VerifyTail:
    """The graphs replayed after one verify graph (its static inputs ``verify`` and output ``out``): the argmax, and
    the acceptance, fold, catch-up and chain (the module's docstring)."""

    def __init__(self, spec, verify: StepBuffers, out: torch.Tensor, width: int):
        self.spec, self.verify, self.out = spec, verify, out
        bs, dev = verify.bs, out.device
        self.targets = torch.zeros(bs * verify.q, dtype=torch.long, device=dev)
        self.caps = torch.zeros(bs, dtype=torch.int32, device=dev)  # each row's block table, in tokens
        self.catchup = CatchupBuffers(spec, bs, width, verify.scratch_block, verify.scratch_slot)

    def argmax(self) -> torch.Tensor:
        self.targets.copy_(self.spec.model.compute_logits(self.out).argmax(-1))
        return self.targets

    def body(self) -> torch.Tensor:
        """-> the drafts [k, bs]."""
        s, v, c = self.spec, self.verify, self.catchup
        vb, cb, bsz = v.batch, c.step.batch, s.block_size
        bs, q, k = v.bs, v.q, s.num_tokens
        slots = vb.slot_mapping.view(bs, q)
        real = slots != v.scratch_entry
        ns = real.sum(1)  # each row's fed tokens; 0: a padding row
        live = ns > 0
        fed, tgt = v.input_ids.view(bs, q), self.targets.view(bs, q)
        m = 1 + ((tgt[:, :k] == fed[:, 1:]) & real[:, 1:]).long().cumprod(1).sum(1)
        fold_layers(s.cache, vb.state_slots_t.int(), torch.where(live, m, 0).int())
        ctx = vb.seq_lens_t.long() - ns  # the rows' context before the step
        ids = c.step.input_ids.view(bs, q + 1)
        ids[:, 0], ids[:, 1:] = fed[:, 0], tgt
        hidden = c.hidden.view(bs, q + 1, -1)
        hidden[:, 0], hidden[:, 1:] = s.hidden.rows[vb.state_slots_t], self.out.view(bs, q, -1)
        e = torch.arange(q + 1, device=ns.device)
        cb.positions.view(bs, q + 1).copy_(ctx[:, None] - 1 + torch.minimum(e[None, :], ns[:, None]))
        prev = (ctx - 1).clamp(min=0)  # the previous step's last position
        first = vb.block_tables_t.gather(1, (prev // bsz)[:, None])[:, 0].long() * bsz + prev % bsz
        mapping = cb.slot_mapping.view(bs, q + 1)
        mapping[:, 0], mapping[:, 1:] = torch.where(live, first, v.scratch_entry), slots
        cb.seq_lens_t.copy_(vb.seq_lens_t)
        cb.block_tables_t.copy_(vb.block_tables_t)
        cb.state_slots_t.copy_(vb.state_slots_t)
        rows = torch.arange(bs, device=ns.device)
        c.last.copy_(rows * (q + 1) + m)  # each row's m-th entry
        # the chain from position context + m; a padding row at position 1 of the scratch block, as ChainBuffers pads
        ch = c.chain
        fill_chain((torch.where(live, ctx + m, 1), torch.where(live, self.caps, 2), vb.block_tables_t),
                   (ch.block_tables, ch.slot_mapping, ch.positions, ch.seq_lens), bsz,
                   (ch.scratch_entry, ch.scratch_block))
        drafts = c.body()
        s.hidden.rows[vb.state_slots_t] = self.out.view(bs, q, -1)[rows, m - 1]
        return drafts


class CapturedTail(NamedTuple):
    argmax: torch.cuda.CUDAGraph
    tail: VerifyTail
    body: torch.cuda.CUDAGraph
    drafts: torch.Tensor  # the body's output [k, bs], rewritten by each replay


class OverlappedStep:
    def __init__(self, spec) -> None:
        self.spec = spec
        self.tails: dict[tuple[int, int, int], CapturedTail] = {}  # per verify graph key
        self._pinned = torch.empty(0, dtype=torch.long)

    def can_run(self, sched: list[ScheduledRequest], feeds: list[list[int]], replayed: Replayed | None) -> bool:
        """Whether this verify step can run overlapped (see the module's docstring)."""
        s = self.spec
        if (replayed is None or replayed.key not in self.tails or 0 < s.max_batch < len(sched)):
            return False
        for sr, f in zip(sched, feeds):
            p = sr.sampling
            if (not sr.sample or not p.greedy or p.has_penalties or p.logprobs is not None or p.grammar is not None
                    or sr.num_new_tokens != 1 or sr.context_len == 0 or sr.request_id not in s.hidden
                    or sr.request_id in s.deferred):
                return False
        return True

    def capture(self, graphs, keys: list[tuple[int, int, int]] | None = None) -> int:
        """Capture the tails of ``graphs``' (``DecodeGraphs``) verify graphs that have none (of ``keys``; default: all
        it holds), each with its verify graph's inputs cleared first, so that the capture's runs touch only the
        scratch block and slot; -> how many were new."""
        q = self.spec.num_tokens + 1
        keys = [key for key in (keys if keys is not None else graphs.graphs)
                if key[2] == q and key not in self.tails]
        graphs.capture(keys)
        for key in keys:
            _, buf, out = graphs.graphs[key]
            buf.clear()
            tail = VerifyTail(self.spec, buf, out, key[1])
            argmax, _ = graphs.pool.capture(tail.argmax)
            body, drafts = graphs.pool.capture(tail.body)
            self.tails[key] = CapturedTail(argmax, tail, body, drafts)
        return len(keys)

    def launch(self, sched: list[ScheduledRequest], feeds: list[list[int]], replayed: Replayed,
               caps: torch.Tensor) -> PendingAccept:
        """Accept, fold and draft on the device for a verify step (``can_run``) whose graph ``replayed`` has just
        replayed, its tail captured (``capture``, before that replay); ``caps`` its rows' block tables in tokens, on
        the device."""
        s = self.spec
        s.resolve(sched, feeds)  # the previous drafts' copy is over: its pinned buffer takes this step's
        argmax, tail, body, drafts = self.tails[replayed.key]
        tail.caps[: len(sched)].copy_(caps)
        argmax.replay()
        host, copied = tail.targets, None
        if host.is_cuda:
            T = host.numel()
            if self._pinned.numel() < T:
                self._pinned = torch.empty(max(1024, T), dtype=torch.long, pin_memory=True)
            host = self._pinned[:T]
            host.copy_(tail.targets, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        body.replay()
        s.keep_drafts(drafts)
        return PendingAccept([(sr, f) for sr, f in zip(sched, feeds)], replayed.buf.q, host, copied)

    def finish(self, p: PendingAccept, result: StepResult) -> None:
        """The step's tokens into ``result`` once the argmax is on the host; the kept drafts' rows filed."""
        s = self.spec
        if p.copied is not None:
            p.copied.synchronize()
        targets = p.targets.tolist()
        rows = []
        for b, (sr, fed) in enumerate(p.rows):
            drafts = fed[1:]
            at = targets[b * p.q : b * p.q + len(fed)]
            out = s.count(greedy_accept(at, drafts), drafts) if drafts else at[:1]
            rid = sr.request_id
            if drafts or sr.num_draft:  # the scheduler reads a drafting row's tokens from ``emitted``
                result.emitted[rid] = out
            if not drafts:
                result.sampled[rid] = out[0]
            pos = sr.context_len + len(out)
            rows.append((rid, chain_steps([pos], [sr.block_table], s.num_tokens, s.block_size)[0]))
        s.file_drafts(rows)
