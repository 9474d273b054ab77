"""Speculative decoding with the checkpoint's MTP layer: drafting, acceptance, the ReplaySSM fold.

Per step (``ModelRunner.execute`` calls these around the target's forward pass):

1. ``feeds``: each row scheduled with ``num_draft > 0`` gets up to that many drafts from the previous step
   appended to its fed token. The drafts stay on the device: the host feeds placeholders, the device gathers the
   drafts into the step's tokens, and the host learns their values (``resolve``) only for the acceptance, after the
   step is launched, so it never waits for the draft to schedule and launch the next step. When any row carries
   drafts, the batch's ``replay`` flags send those rows
   (and the plain decode rows, so they too follow the decode recurrence bit for bit) through the KDA
   layers' verify path: the checkpoint is read, the ring written.
2. ``accept_rows``: logits at every fed position of a draft row (one product for all rows without penalties or
   logprobs), penalised as the sampler would at that position (the counts include the drafts before it, which are the
   outputs there whenever the position's token is emitted); greedy rows keep the drafts equal to the target's argmax,
   sampled rows run rejection sampling (``spec_accept``), those without penalties or logprobs all together on the
   device. Each emitted token's logprob record comes from the raw logits at its position, as the sampler's do.
   ``fold`` then replays the committed tokens into each KDA checkpoint and shifts the conv window. Rejected drafts
   leave entries in the paged MLA / indexer caches past the committed length: nothing reads them (attention and the
   k-pool indexer read up to the sequence length) and the next step overwrites them, so a rejection is a cursor move.
3. ``draft``: the MTP layer catches up over the committed positions (its entry at position ``i`` reads the
   target hidden at ``i`` and the token at ``i + 1``; the hidden of the previous step's last position is
   kept per request), the last entry (with the token just emitted) gives the first draft, and ``k - 1``
   single-token MTP steps chain the rest (their cache entries beyond the committed length are
   overwritten later too).

A verify step whose rows are all greedy and draft from graphs runs steps 2 and 3 on the device before the host
reads a token (``engine/spec_overlap.py``); the host then files its tokens while the device folds and drafts.

With CUDA graphs a verify step whose rows all decode replays a captured forward (``engine/cuda_graphs.py``), and
so do the catch-up and the chain, as one graph (``engine/draft_graphs.py``), when every row's catch-up is at most
``k + 2`` entries (the previous step's last position and the ``k + 1`` it may commit); a longer catch-up (after a
prompt, or over deferred positions) runs eagerly, then the chain's own graph.

Drafts are greedy (the MTP's argmax), so the draft distribution in rejection sampling is one-hot.

Drafting pays while the batch is small: a verify step feeds ``k + 1`` tokens per row, and once the step is
bound by its rows rather than by its launches, the accepted drafts no longer cover that. With
``max_batch`` (``--speculative-max-batch``), a step that leaves more rows going on than that drafts nothing for the
next: the MTP layer's catch-up is deferred too (each row keeps its target hiddens and tokens since its last
catch-up, ``deferred``), so the next step is a plain decode step, replayed from the decode graphs; when the batch
shrinks again, one catch-up covers every deferred position and drafting resumes. A row defers at most
``MAX_DEFERRED`` positions; past that its catch-up runs (without drafts for the row's next step).
"""

from __future__ import annotations

import itertools

import torch

from flashinfra.engine.cuda_graphs import DecodeGraphs
from flashinfra.engine.draft_graphs import ChainBuffers, DraftGraphs, FoldGraphs, chain_steps
from flashinfra.engine.sampler import Fill, SamplingRow, apply_penalties, position_probs, token_logprobs
from flashinfra.engine.sched.messages import TokenLogprob
from flashinfra.engine.sched.plan import PLACEHOLDER_TOKEN, ScheduledRequest
from flashinfra.engine.spec_accept import greedy_accept, rejection_accept_rows
from flashinfra.engine.spec_overlap import OverlappedStep
from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.loader import CheckpointReader
from flashinfra.model.mtp import MTPBlock, allocate_mtp_cache, has_mtp, load_mtp
from flashinfra.model.replay import ReplayRing, kda_fold
from flashinfra.model.staging import HostStaging

MAX_DEFERRED = 1024  # positions a row's catch-up may wait while drafting is off: 1024 x hidden size per row


class LastHidden:
    """Each drafting request's target hidden state at its last committed position (the MTP layer's next catch-up
    starts from it), kept in the row of the request's KDA state slot, so that a step's graphs gather and write them
    by the batch's state slots."""

    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.rows = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self.slots: dict[str, int] = {}  # request -> its row

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.slots

    def get(self, request_id: str) -> torch.Tensor | None:
        """The request's hidden state [D] (a view of its row, which the request's next step rewrites), or None."""
        slot = self.slots.get(request_id)
        return None if slot is None else self.rows[slot]

    def put(self, kept: list[tuple[str, int]], slots: torch.Tensor, hidden: torch.Tensor) -> None:
        """``hidden[i]`` for ``kept[i]`` (a request and its state slot), ``slots`` those slots on the device."""
        self.rows[slots] = hidden
        self.slots.update(kept)

    def set(self, request_id: str, slot: int, hidden: torch.Tensor) -> None:
        self.rows[slot].copy_(hidden)
        self.slots[request_id] = slot

    def pop(self, request_id: str) -> None:
        self.slots.pop(request_id, None)


class Speculator:
    def __init__(self, model: LoadedModel, cache: ModelCache, num_tokens: int, block_size: int,
                 graphs: DecodeGraphs | None = None, max_batch: int = 0):
        """``graphs``: the runner's step graphs, whose scratch block, slot and memory pool the chained draft steps'
        graphs share (``engine/draft_graphs.py``); None: the chain runs eagerly. ``max_batch``: draft only while a
        step leaves at most this many rows going on (0: always)."""
        text = model.config.text
        reader = CheckpointReader(model.path)
        if not has_mtp(model.config, reader.names()):
            raise ValueError(f"speculative decoding needs the checkpoint's MTP layer "
                             f"(layers.{text.num_hidden_layers}.*); {model.path} has none")
        with torch.device(model.device):
            self.mtp = MTPBlock(text, model.dtype)
        load_mtp(self.mtp, model.config, reader)
        self.mtp.eval()
        self.model, self.num_tokens, self.block_size = model, num_tokens, block_size
        self.device = model.device
        self.mtp_cache = allocate_mtp_cache(text, cache.num_blocks, block_size, cache.num_slots, model.dtype,
                                            model.device)
        self.cache = cache
        self.capacity = num_tokens + 1  # ring entries: the fed token and the drafts
        H, K = text.linear_num_heads, text.linear_head_dim
        cache.replay.update({i: ReplayRing.allocate(cache.num_slots, self.capacity, H, K, K, model.dtype, model.device)
                             for i in text.kda_layers})
        self.hidden = LastHidden(cache.num_slots, text.hidden_size, model.dtype, model.device)
        # request -> (hiddens at positions c - 1 - j .. c - 2 in parts [*, D], the tokens at c - j .. c - 1) whose MTP
        # entries wait for drafting to resume (c: the request's context at its next step)
        self.deferred: dict[str, tuple[list[torch.Tensor], list[int]]] = {}
        self.max_batch = max_batch
        self._drafts: dict[str, list[int]] = {}  # request -> its drafts for its next step, on the host
        # the last drafts on their way to the host: (device [k, n], its host copy, the copy's event or None, each
        # column's (request or None, chained steps)), and request -> (its column, its number of drafts) while they
        # are: the next step feeds them from the device before they arrive
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None, list] | None = None
        self._columns: dict[str, tuple[int, int]] = {}
        self._pinned = torch.empty(0, dtype=torch.long)
        self.num_drafted = 0
        self.num_drafted_at: list[int] = [0] * num_tokens  # drafts verified per draft position
        self.num_accepted_at: list[int] = [0] * num_tokens  # accepted drafts per draft position
        self.graphs = DraftGraphs(self, graphs) if graphs is not None else None
        self.fold_graphs = FoldGraphs(cache, graphs) if graphs is not None and cache.replay else None
        self.staging = HostStaging(model.device)  # the fold's and the draft's inputs, copied without a host sync
        self.overlap = OverlappedStep(self)  # steps whose acceptance, fold and draft all run on the device

    @property
    def drafts(self) -> dict[str, list[int]]:
        """Each request's drafts for its next step, on the host (waits for the last ones to arrive; the engine's steps
        read them from the device instead, ``feeds``)."""
        self._take_pending()
        return self._drafts

    def _take_pending(self) -> None:
        """Wait for the last drafts' copy to the host, if one is under way, and file them per request."""
        if self._pending is None:
            return
        _, host, copied, rows = self._pending
        self._pending = None
        if copied is not None:
            copied.synchronize()
        for (rid, _), d in zip(rows, ChainBuffers.drafts(host, [n for _, n in rows])):
            if rid in self._columns:  # not dropped since
                self._drafts[rid] = d
        self._columns = {}

    def _read_back(self, out: torch.Tensor, rows: list[tuple[str | None, int]]) -> None:
        """Keep the drafts ``out`` [k, n] (column r: ``rows[r]``, its request or None and its chained steps) on the
        device for the next step's feeds, and start their copy to the host (for the acceptance)."""
        self.keep_drafts(out)
        self.file_drafts(rows)

    def keep_drafts(self, out: torch.Tensor) -> None:
        """Keep the drafts ``out`` [k, n] on the device for the next step's feeds and start their copy to the host;
        which request each column drafts for follows (``file_drafts``)."""
        self._take_pending()
        host, copied = out, None
        if out.is_cuda:
            if self._pinned.numel() < out.numel():
                self._pinned = torch.empty(max(1024, out.numel()), dtype=torch.long, pin_memory=True)
            host = self._pinned[: out.numel()].view(out.shape)
            host.copy_(out, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        self._pending = (out, host, copied, [])

    def file_drafts(self, rows: list[tuple[str | None, int]]) -> None:
        """The kept drafts' columns: ``rows[r]`` (request or None, chained steps) for column r."""
        out, host, copied, _ = self._pending
        self._pending = (out, host, copied, rows)
        self._columns = {rid: (col, 1 + n) for col, (rid, n) in enumerate(rows) if rid is not None}

    def drop(self, request_id: str) -> None:
        self.hidden.pop(request_id)
        self.deferred.pop(request_id, None)
        self._drafts.pop(request_id, None)
        self._columns.pop(request_id, None)

    def feeds(self, sched: list[ScheduledRequest]) -> tuple[list[list[int]], tuple[bool, ...], Fill | None]:
        """Tokens fed per row (drafts appended), the batch's replay flags (empty: no row has drafts) and the drafts
        still on the device: ``PLACEHOLDER_TOKEN`` in the feeds, filled on the device from ``(source, [(position
        in the step's flat tokens, index into source)])`` and on the host by ``resolve``."""
        feeds, at, fill = [], 0, []
        for sr in sched:
            f, rid = list(sr.token_ids), sr.request_id
            if sr.num_draft and rid in self._columns:
                col, n = self._columns[rid]
                bs = self._pending[0].shape[1]
                fill.extend((at + len(f) + j, j * bs + col) for j in range(min(n, sr.num_draft)))
                f += [PLACEHOLDER_TOKEN] * min(n, sr.num_draft)
            elif sr.num_draft:
                f += self._drafts.get(rid, [])[: sr.num_draft]
            feeds.append(f)
            at += len(f)
        source = (self._pending[0].view(-1), fill) if fill else None
        if all(len(f) == sr.num_new_tokens for f, sr in zip(feeds, sched)):
            return feeds, (), source
        return feeds, tuple(len(f) > sr.num_new_tokens or (len(f) == 1 and sr.context_len > 0)
                            for f, sr in zip(feeds, sched)), source

    def resolve(self, sched: list[ScheduledRequest], feeds: list[list[int]]) -> None:
        """Replace the placeholder drafts in ``feeds`` by their values, once their copy to the host has arrived."""
        if not any(sr.request_id in self._columns for sr, f in zip(sched, feeds) if len(f) > sr.num_new_tokens):
            return
        self._take_pending()
        for sr, f in zip(sched, feeds):
            n = sr.num_new_tokens
            if len(f) > n and f[n] == PLACEHOLDER_TOKEN:
                f[n:] = self._drafts[sr.request_id][: len(f) - n]

    def accept_rows(self, rows: list[tuple[ScheduledRequest, list[int], int, int]], hidden: torch.Tensor,
                    generator, shared: torch.Generator | None = None
                    ) -> list[tuple[list[int], list[TokenLogprob] | None]]:
        """Each draft row ``(request, fed tokens, first, end)`` (its rows ``first:end`` of ``hidden``) -> its emitted
        tokens and logprob records. The rows without penalties or logprobs share one logits product: the greedy ones
        one argmax and read-back, the sampled ones one rejection sampling over all their positions
        (``rejection_accept_rows``); the others go through ``accept`` one by one. ``generator(request)``: a sampled
        row's generator of its own, or None to draw from ``shared``."""
        plain = [r for r in rows if not r[0].sampling.has_penalties and r[0].sampling.logprobs is None]
        out: dict[int, tuple[list[int], None]] = {}
        if plain:
            spans = [(lo, hi) for _, _, lo, hi in plain]
            contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            h = (hidden[spans[0][0] : spans[-1][1]] if contiguous else hidden[torch.tensor(
                [i for lo, hi in spans for i in range(lo, hi)], dtype=torch.long, device=hidden.device)])
            logits = self.model.compute_logits(h)
            sizes = [hi - lo for lo, hi in spans]
            first = [0, *itertools.accumulate(sizes)]  # each row's first position in ``logits``
            for greedy in (True, False):
                mine = [i for i, r in enumerate(plain) if r[0].sampling.greedy == greedy]
                if not mine:
                    continue
                part = logits if len(mine) == len(plain) else logits[torch.tensor(
                    [first[i] + j for i in mine for j in range(sizes[i])], device=logits.device)]
                drafts = [plain[i][1][plain[i][0].num_new_tokens:] for i in mine]
                if greedy:
                    targets, at, emitted = torch.argmax(part, -1).tolist(), 0, []
                    for i, d in zip(mine, drafts):
                        emitted.append(greedy_accept(targets[at : at + sizes[i]], d))
                        at += sizes[i]
                else:
                    params = [plain[i][0].sampling for i in mine]
                    emitted = rejection_accept_rows(position_probs(part, params, [sizes[i] for i in mine]), drafts,
                                                    [generator(plain[i][0]) for i in mine], shared)
                for i, d, e in zip(mine, drafts, emitted):
                    out[id(plain[i][0])] = (self.count(e, d), None)
        return [out[id(sr)] if id(sr) in out else self.accept(sr, fed, hidden[lo:hi], generator(sr), shared)
                for sr, fed, lo, hi in rows]

    def count(self, out: list[int], drafts: list[int]) -> list[int]:
        """Count a row's verified and accepted drafts (``out``: its emitted tokens); -> ``out``."""
        self.num_drafted += len(drafts)
        for j in range(len(drafts)):
            self.num_drafted_at[j] += 1
        for j in range(len(out) - 1):
            self.num_accepted_at[j] += 1
        return out

    def accept(self, sr: ScheduledRequest, fed: list[int], hidden: torch.Tensor, generator: torch.Generator | None,
               shared: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprob] | None]:
        """hidden [len(fed), D] of a draft row -> the emitted tokens and, if the request asks, their logprob
        records (``generator``: a sampled row's own, or None to draw from ``shared``)."""
        drafts = fed[sr.num_new_tokens:]
        raw = self.model.compute_logits(hidden)
        s = sr.sampling
        rows = [SamplingRow(s, sr.prompt_token_ids, list(sr.output_token_ids) + drafts[:j], generator)
                for j in range(raw.shape[0])]
        logits = apply_penalties(raw.float().clone(), rows)
        if s.greedy:
            out = greedy_accept(torch.argmax(logits, -1).tolist(), drafts)
        else:
            probs = position_probs(logits, [s], [logits.shape[0]])
            out = rejection_accept_rows(probs, [drafts], [generator], shared)[0]
        self.count(out, drafts)
        if s.logprobs is None:
            return out, None
        n = len(out)
        return out, token_logprobs(raw[:n], torch.tensor(out, device=raw.device), rows[:n])

    def fold(self, sched: list[ScheduledRequest], replay: tuple[bool, ...], committed: list[int]) -> None:
        """Fold each replay row's committed tokens into its KDA checkpoints."""
        rows = [b for b, r in enumerate(replay) if r]
        if not rows:
            return
        slots, ns = [sched[b].state_slot for b in rows], [committed[b] for b in rows]
        i32 = torch.int32
        views = self.staging.upload([("slots", i32, slots, (len(rows),)), ("ns", i32, ns, (len(rows),))])
        if self.fold_graphs is not None and self.fold_graphs.can_run(len(rows)) and max(ns) <= self.capacity:
            self.fold_graphs.run(views["slots"], views["ns"])
            return
        for layer, ring in self.cache.replay.items():
            kda_fold(ring, self.cache.conv_state[layer], self.cache.recurrent_state[layer], slots, ns,
                     (views["slots"], views["ns"]))

    @torch.inference_mode()
    def draft(self, sched: list[ScheduledRequest], feeds: list[list[int]], cu: list[int], hidden: torch.Tensor,
              committed: list[int], nexts: list[int | None]) -> None:
        """Catch the MTP layer up over each row's committed positions and draft for the rows that go on."""
        embed = self.model.model.embed_tokens
        rows, hid, toks, qlens, ctxs, slots, tables = [], [], [], [], [], [], []
        going_on = sum(1 for b in range(len(sched)) if committed[b] and nexts[b] is not None)
        defer = 0 < self.max_batch < going_on
        kept, ends = [], []  # each row's (request, slot) and last committed position, gathered once below
        for b, sr in enumerate(sched):
            rid, c, m, nxt = sr.request_id, sr.context_len, committed[b], nexts[b]
            if m == 0:
                continue
            h_rows = hidden[cu[b] : cu[b] + m]
            tokens = feeds[b][:m] + ([nxt] if nxt is not None else [])
            prev = self.hidden.get(rid) if c > 0 else None
            kept.append((rid, sr.state_slot))
            ends.append(cu[b] + m - 1)
            self._drafts.pop(rid, None)
            waiting_h, waiting_t = self.deferred.pop(rid, ([], [])) if prev is not None else ([], [])
            if defer and prev is not None and nxt is not None and len(waiting_t) + m <= MAX_DEFERRED:
                # parts, concatenated once when drafting resumes (a copy of this step's rows only after drafts)
                parts = waiting_h + [prev[None].clone()] + ([h_rows[: m - 1].clone()] if m > 1 else [])
                self.deferred[rid] = (parts, waiting_t + feeds[b][:m])
                continue
            hs = waiting_h + ([prev[None]] if prev is not None else []) + [h_rows[: len(tokens) - 1]]
            tk = waiting_t + (tokens if prev is not None else tokens[1:])
            if not tk:
                continue
            rows.append((b, nxt is not None and not defer))
            hid.extend(hs)
            toks.extend(tk)
            qlens.append(len(tk))
            ctxs.append(c - 1 - len(waiting_t) if prev is not None else c)
            slots.append(sr.state_slot)
            tables.append(list(sr.block_table))
        # one packed copy: the rows' last positions, and the catch-up's batch and tokens
        arrays = ForwardBatch.host_arrays(qlens, ctxs, slots, tables, self.block_size) if rows else []
        views = self.staging.upload(arrays + [("ends", torch.int64, ends, (len(ends),)),
                                              ("kept", torch.int64, [slot for _, slot in kept], (len(kept),)),
                                              ("ids", torch.int64, toks, (len(toks),))])
        hid = torch.cat(hid) if rows else None  # before the kept rows overwrite the last hiddens it reads
        if ends:
            self.hidden.put(kept, views["kept"], hidden[views["ends"]])
        if not rows:
            return
        ids = views["ids"]
        batch = ForwardBatch.from_views(qlens, ctxs, slots, tables, self.block_size, views)
        if self.graphs is not None and self.graphs.can_catch_up(qlens):  # a row that stops drafts for nothing
            pos = [c + q for c, q in zip(ctxs, qlens)]
            steps = chain_steps(pos, tables, self.num_tokens, self.block_size)
            out = self.graphs.run_catchup(ids, hid, batch, pos, tables)
            self._read_back(out, [(sched[b].request_id if go else None, n) for (b, go), n in zip(rows, steps)])
            return
        out = self.mtp(embed[ids], hid, batch, self.mtp_cache)
        last = [batch.cu_seqlens_list[i + 1] - 1 for i in range(len(rows))]
        live = [i for i, (_, go) in enumerate(rows) if go]
        if not live:
            return
        h = out[[last[i] for i in live]]
        pos = [ctxs[i] + qlens[i] for i in live]  # the first chained entry's position
        live_tables = [tables[i] for i in live]
        steps = chain_steps(pos, live_tables, self.num_tokens, self.block_size)
        if self.graphs is not None and self.num_tokens > 1 and self.graphs.can_run(len(live)):
            out = self.graphs.run(h, pos, live_tables)
        else:
            out = self._chain(h, pos, [slots[i] for i in live], live_tables, steps)
        self._read_back(out, [(sched[rows[i][0]].request_id, n) for i, n in zip(live, steps)])

    def _chain(self, h: torch.Tensor, pos: list[int], slots: list[int], tables: list[list[int]],
               steps: list[int]) -> torch.Tensor:
        """The eager chain -> the drafts [k, n]: the first of each row from ``h`` (the catch-up's last entry), then its
        ``steps`` single-token MTP steps (``chain_steps``), the rows that still go on in each (a row's column past its
        steps stays 0, as a graph's holds what its scratch steps drew: ``_read_back`` keeps ``1 + steps``)."""
        embed = self.model.model.embed_tokens
        drafts = torch.zeros(self.num_tokens, len(pos), dtype=torch.long, device=self.device)
        cur = list(range(len(pos)))
        for j in range(self.num_tokens):
            tok = self.model.compute_logits(self.mtp.logits_hidden(h)).argmax(-1)
            drafts[j, cur] = tok
            keep = [x for x, r in enumerate(cur) if steps[r] > j]
            if j + 1 == self.num_tokens or not keep:
                break
            cur, h, tok = [cur[x] for x in keep], h[keep], tok[keep]
            batch = ForwardBatch.build([1] * len(cur), [pos[r] + j for r in cur], [slots[r] for r in cur],
                                       [tables[r] for r in cur], self.block_size, self.device)
            h = self.mtp(embed[tok], h, batch, self.mtp_cache)
        return drafts
