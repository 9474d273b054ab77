"""Continuous-batching scheduler: decides, each step, which requests advance and by how many tokens.

One loop, no phases. Every running request's ``num_computed_tokens`` catches up to its ``num_tokens``
under a per-step token budget (``max_num_batched_tokens``) and a batch-size cap (``max_num_seqs``). A long
prompt is split over several steps (chunked prefill); a decode step is a catch-up of one token.

Priority is first come, first served. Running requests are served before waiting ones. When the cache
runs out of blocks, the most recently admitted running request is preempted by recompute: its blocks and
state slot are freed and it goes back to the front of the queue with ``num_computed_tokens = 0``, keeping
the tokens it already generated. No new request is admitted in a step that preempted.

With prefix caching on (the cache manager has checkpoint slots), a request admitted with nothing computed
starts after the longest cached prefix of its tokens (its KDA state is loaded from the checkpoint), and every
checkpoint position of its prompt that a step crosses gets a checkpoint slot (while one is free; else that
checkpoint is skipped): the runner writes the KDA state there inside the step, and the prefix is registered
after it. Only the token budget cuts a step.

Disaggregated serving: a request exported by a prefill-role engine keeps its blocks and state slot after it
finishes (``held``) until the decode side acknowledges the transfer (``release_held``); a decode-role
engine admits a request whose prompt was computed elsewhere with ``admit_imported``.

Deterministic mode (``EngineConfig.deterministic``) cuts prompt pieces as ``sched/aligned.py`` says.

Asynchronous scheduling (``SchedulerConfig.async_scheduling``): a step's progress is counted when it is scheduled,
and each row that samples adds a placeholder output token (``Request.num_output_placeholders``) until ``update``
brings the token, so the next step can be scheduled while this one runs (``schedule(ahead=True)``): a placeholder
is fed as ``PLACEHOLDER_TOKEN``, which the runner replaces on the device. A stop is then found one step late: the
row the next step computed for a finished request is discarded (``update`` skips requests no longer running). A
request whose placeholders reach its length limit is not scheduled again. A step ahead never preempts; the
engine waits for the result instead, then schedules synchronously.

Pure Python: this module imports no torch (a test enforces it), so it can be reasoned about and tested
without a model.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from flashinfra.engine.sched.aligned import aligned_piece
from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import EngineStats, RequestOutput
from flashinfra.engine.sched.plan import PLACEHOLDER_TOKEN, Plan, ScheduledRequest, StepResult
from flashinfra.engine.sched.request import Request, RequestStatus
from flashinfra.engine.sched.scheduler_config import SchedulerConfig


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: HybridCacheManager,
        events: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.cache = cache
        self.events = events  # anything with .emit(kind, **fields), e.g. feedback.events.EventLog
        self.clock = clock
        # the longest a sequence may grow: the model's limit or the whole cache, whichever is smaller
        self.max_len = min(config.max_model_len, cache.capacity_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}  # finished exports whose cache is being sent
        self._step_id = 0
        self._freed_ids: list[str] = []
        self.num_preemptions_total = 0
        self.num_prefix_hit_tokens_total = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_requests_finished_total = 0

    # ---- requests in and out ----
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.num_prompt_tokens == 0:
            raise ValueError("prompt is empty")
        limit = self.max_len
        if req.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; the limit is {limit - 1} "
                f"(max_model_len {self.config.max_model_len}, cache capacity {self.cache.capacity_tokens})"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Finish these requests now and free their cache; unknown or finished ids are ignored."""
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish(req, "abort")
            outputs.append(self._output(req, [], None))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release_held(self, request_id: str) -> None:
        """Free the cache of a finished export once its transfer is acknowledged (or has failed)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.cache.free(req)

    def admit_imported(self, req: Request, first_token: int, first_logprob=None) -> RequestOutput | None:
        """Admit ``req``, whose prompt was computed by another engine, into the running batch with its first
        token (and that token's logprobs, computed there) pending: a slot and blocks for the prompt are taken
        now (the caller writes the imported state into them). None, with nothing taken, while the batch or the
        cache has no room."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if len(self.running) >= self.config.max_num_seqs:
            return None
        if not self.cache.try_allocate(req, req.num_prompt_tokens):
            return None
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        req.first_scheduled_time = self.clock()
        self.requests[req.request_id] = req
        self.running.append(req)
        req.append_output(first_token)
        self.num_generation_tokens_total += 1
        self.num_prompt_tokens_total += req.num_prompt_tokens
        reason = req.check_stop(self.max_len)
        if reason is not None:
            self._finish(req, reason)
        return self._output(req, [first_token], None if req.sampling.logprobs is None else [first_logprob])

    # ---- one step ----
    def can_schedule_ahead(self, prev: Plan) -> bool:
        """Whether the next step may be scheduled before ``prev``'s result is known. Not after a preemption or a
        prefix checkpoint (its prefix is registered with the result), nor while a row sampled in ``prev`` has a
        grammar (its mask needs the token). (Penalties count the tokens on the device: ``engine/penalties.py``.)"""
        return (self.config.async_scheduling and self.has_unfinished() and not prev.preempted_ids
                and not any(sr.save_states for sr in prev.scheduled)
                and not any(sr.sample and sr.sampling.grammar is not None for sr in prev.scheduled))

    def schedule(self, ahead: bool = False) -> Plan | None:
        """The next step. With asynchronous scheduling every sampled row counts a placeholder output token until
        ``update`` brings it; ``ahead``: a step in flight (see ``can_schedule_ahead``), so no request is preempted:
        None, with no request advanced, where the cache would need it (the caller waits for the result)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        chunk = cfg.max_prefill_chunk or budget
        scheduled: list[tuple] = []  # req, tokens, load, saves[, drafts]
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, min(budget, chunk))
            # n == 0: deterministic mode, too little budget left for an aligned piece; next step
            if n == 0 or self._surely_finishes(req):
                i += 1
                continue
            drafts = self._num_drafts(req, n, budget)
            # cache room for the drafts, and as many positions again for the draft model's chained steps
            target = min(req.num_computed_tokens + n + 2 * drafts, self.max_len)
            if ahead and not self.cache.try_allocate(req, target):
                return None  # blocks taken so far belong to requests that need them in the next step anyway
            while not self.cache.try_allocate(req, target):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: every later request is gone too
            scheduled.append((req, n, None, self._save_slots(req, n), drafts))
            budget -= n + drafts
            i += 1

        now = self.clock()
        while not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            hit = None
            if self.cache.prefix_caching and req.num_computed_tokens == 0:
                hit = self.cache.match_prefix(req)
                if hit is not None:
                    self.cache.use_prefix(req, hit)
            n = self._chunk(req, min(budget, chunk))
            if n == 0 or not self.cache.try_allocate(req, req.num_computed_tokens + n):
                if hit is not None:  # undo: give the shared blocks back, start from 0 next time
                    self.cache.free(req)
                    req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if hit is not None:
                self.num_prefix_hit_tokens_total += hit.length
            scheduled.append((req, n, None if hit is None else hit.slot, self._save_slots(req, n)))
            budget -= n
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self._emit("queue_wait", request_id=req.request_id, wait_s=max(0.0, now - req.arrival_time))

        self._step_id += 1
        freed, self._freed_ids = self._freed_ids, []
        plan = Plan(
            step_id=self._step_id,
            scheduled=[self._scheduled(*entry) for entry in scheduled],
            preempted_ids=preempted,
            finished_ids=freed,
        )
        if cfg.async_scheduling:  # the step's progress counts from now: the next step may start before its result
            for (req, *_), sr in zip(scheduled, plan.scheduled):
                req.num_computed_tokens += sr.num_new_tokens
                req.num_output_placeholders += sr.sample
        return plan

    def update(self, plan: Plan, result: StepResult) -> list[RequestOutput]:
        """Advance every scheduled request by what it computed; return this step's outputs."""
        outputs = []
        for sr in plan.scheduled:
            req = self.requests.get(sr.request_id)
            failed = req is None or req.status is not RequestStatus.RUNNING or sr.request_id in result.errors
            for position, slot in sr.save_states:
                if failed:  # aborted while the step ran, or its step failed
                    self.cache.release_checkpoint_slot(slot)
                else:
                    self.cache.register_prefix(req, position, slot)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if sr.num_draft and sr.request_id in result.emitted and sr.request_id not in result.errors:
                outputs.extend(self._update_speculative(req, sr, result.emitted[sr.request_id],
                                                        result.emitted_logprobs.get(sr.request_id)))
                continue
            if self.config.async_scheduling:  # advanced when scheduled; the sampled token replaces a placeholder
                req.num_output_placeholders -= sr.sample
            else:
                req.num_computed_tokens += sr.num_new_tokens
            if sr.request_id in result.errors:
                self._finish(req, "error", result.errors[sr.request_id])
                outputs.append(self._output(req, [], None))
                continue
            if not sr.sample:
                continue
            token = result.sampled[sr.request_id]
            req.append_output(token)
            self.num_generation_tokens_total += 1
            if req.num_output_tokens == 1:
                self.num_prompt_tokens_total += req.num_prompt_tokens
            reason = req.check_stop(self.max_len)
            if reason is not None:
                self._finish(req, reason)
            lp = result.logprobs.get(sr.request_id)
            outputs.append(self._output(req, [token], None if req.sampling.logprobs is None else [lp]))
        return outputs

    def stats(self, step_duration_s: float = 0.0, num_batched_tokens: int = 0) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            cache_usage=self.cache.block_usage(),
            num_preemptions_total=self.num_preemptions_total,
            state_slot_usage=self.cache.slot_usage(),
            num_blocks_total=self.cache.num_blocks,
            num_blocks_free=self.cache.num_reclaimable_blocks,
            num_prefix_hit_tokens_total=self.num_prefix_hit_tokens_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_requests_finished_total=self.num_requests_finished_total,
            step_duration_s=step_duration_s,
            num_batched_tokens=num_batched_tokens,
            num_transfers_held=len(self.held),
        )

    # ---- internals ----
    def _surely_finishes(self, req: Request) -> bool:
        """A request whose placeholder tokens reach its length limits: the step in flight ends it."""
        pending = req.num_output_placeholders
        return bool(pending) and (req.num_output_tokens + pending >= req.sampling.max_tokens
                                  or req.num_tokens + pending >= self.max_len)

    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Draft tokens for a decoding request (one pending token after at least one output): the
        configured count, within the token budget and the length limits."""
        k, s = self.config.speculative_tokens, req.sampling
        if not k or n != 1 or req.num_pending_tokens != 1 or not req.output_token_ids or not req.num_computed_tokens:
            return 0
        left = min(self.max_len - req.num_tokens, s.max_tokens - req.num_output_tokens) - 1
        return max(0, min(k, budget - n, left))

    def _update_speculative(self, req: Request, sr: ScheduledRequest, tokens: list[int],
                            logprobs: list | None) -> list[RequestOutput]:
        """Commit a verified step: the fed token and the accepted drafts enter the cache (a rejected draft
        is simply not counted: its cache entries are overwritten later), the emitted tokens (with their
        logprob records, one each) are appended until one stops the request."""
        req.num_computed_tokens += len(tokens)
        out: list[int] = []
        for token in tokens:
            req.append_output(token)
            out.append(token)
            self.num_generation_tokens_total += 1
            reason = req.check_stop(self.max_len)
            if reason is not None:
                self._finish(req, reason)
                break
        return [self._output(req, out, None if req.sampling.logprobs is None else list(logprobs)[: len(out)])]

    def _chunk(self, req: Request, limit: int) -> int:
        """Tokens ``req`` computes this step: up to ``limit`` (aligned in deterministic mode)."""
        n = min(req.num_pending_tokens, limit)
        return aligned_piece(req, req.num_computed_tokens, n) if self.config.deterministic else n

    def _save_slots(self, req: Request, n: int) -> tuple[tuple[int, int], ...]:
        """A checkpoint slot for each of ``req``'s checkpoint positions this step crosses, while slots last."""
        start = req.num_computed_tokens
        if not self.cache.prefix_caching or start >= req.num_prompt_tokens:  # checkpoints lie inside the prompt
            return ()
        saves = []
        for position in self.cache.checkpoints_between(req, start, start + n):
            slot = self.cache.reserve_checkpoint_slot()
            if slot is None:
                break
            saves.append((position, slot))
        return tuple(saves)

    def _scheduled(self, req: Request, n: int, load: int | None, saves: tuple[tuple[int, int], ...],
                   drafts: int = 0) -> ScheduledRequest:
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start : start + n]
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=tokens + [PLACEHOLDER_TOKEN] * (n - len(tokens)),
            context_len=start,
            block_table=req.block_ids,
            blocks_epoch=req.blocks_epoch,
            state_slot=req.state_slot,
            sample=start + n == req.num_tokens + req.num_output_placeholders,
            sampling=req.sampling,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            load_state_from=load,
            save_states=saves,
            mm_items=(tuple(it for it in req.mm_items if it.offset < start + n and it.end > start) if req.mm_items
                      else ()),
            num_draft=drafts,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.num_preemptions_total += 1
        self._emit("preempt", request_id=req.request_id, reason="no free cache blocks", num_tokens=req.num_tokens)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.transfer is not None and req.transfer.role == "export" and reason in ("stop", "length"):
            self.held[req.request_id] = req  # its cache is sent after this step; freed on the ack
        else:
            self.cache.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        del self.requests[req.request_id]
        self._freed_ids.append(req.request_id)
        self.num_requests_finished_total += 1

    def _output(self, req: Request, tokens: list[int], logprobs: list | None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            logprobs=logprobs,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            error=req.error,
            num_prompt_tokens=req.num_prompt_tokens,
        )

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)
