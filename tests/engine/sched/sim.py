"""The scheduler's test harness: a simulated model that checks every cache address it is given.

``SimRunner`` writes each fed token into the paged cache at the slots the plan names and keeps each KDA slot's
consumed tokens; before a step it verifies that the blocks and the slot a request brings hold exactly that
request's earlier tokens. The next token is a hash of the whole sequence (``next_token``), so any scheduling
mistake (lost, repeated or misplaced tokens) changes the outputs (``expected_output``).
"""

from __future__ import annotations

import random

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import SamplingParams, TokenLogprob
from flashinfra.engine.sched.plan import Plan, StepResult
from flashinfra.engine.sched.request import Request
from flashinfra.engine.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 1000
EOS = 7


def sched_config(max_model_len: int, **engine: int) -> SchedulerConfig:
    """The scheduler's limits as the engine derives them, from ``EngineConfig`` fields."""
    return SchedulerConfig.from_engine(EngineConfig(**engine), max_model_len)


def next_token(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 1000003 + t + 1) % 2**61
    return h % VOCAB


class SimRunner:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, num_prefix_slots: int = 0) -> None:
        self.block_size = block_size
        self.paged: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.slots: list[list[int] | None] = [None] * (num_slots + num_prefix_slots)

    def execute(self, plan: Plan, limits: SchedulerConfig) -> StepResult:
        assert plan.num_tokens <= limits.max_num_batched_tokens
        assert len(plan.scheduled) <= limits.max_num_seqs
        slots_used = [sr.state_slot for sr in plan.scheduled]
        assert len(set(slots_used)) == len(slots_used), "two requests share a KDA slot"
        bs = self.block_size
        for sr in plan.scheduled:  # blocks written this step belong to the writer alone
            written = {sr.block_table[p // bs] for p in range(sr.context_len, sr.context_len + sr.num_new_tokens)}
            for other in plan.scheduled:
                if other is not sr:
                    assert not written & set(other.block_table), "a block written this step is shared"
        result = StepResult()
        for sr in plan.scheduled:  # prefix hits: load checkpoints before the step
            if sr.load_state_from is not None:
                self.slots[sr.state_slot] = list(self.slots[sr.load_state_from])
        for sr in plan.scheduled:
            bs = self.block_size
            end = sr.context_len + sr.num_new_tokens
            assert len(sr.block_table) * bs >= end
            full = sr.prompt_token_ids + sr.output_token_ids
            for p in range(sr.context_len):  # the cache holds the earlier tokens where the table says
                assert self.paged[sr.block_table[p // bs]][p % bs] == full[p]
            if sr.context_len == 0:
                self.slots[sr.state_slot] = []
            assert self.slots[sr.state_slot] == full[: sr.context_len]
            assert sr.token_ids == full[sr.context_len : end]
            for p, t in zip(range(sr.context_len, end), sr.token_ids):
                self.paged[sr.block_table[p // bs]][p % bs] = t
            # checkpoints are written inside the step, at every checkpoint position it crosses
            positions = [pos for pos, _ in sr.save_states]
            assert positions == sorted(positions)
            for pos, slot in sr.save_states:
                assert pos % bs == 0 and sr.context_len < pos <= end and pos < len(sr.prompt_token_ids)
                self.slots[slot] = full[:pos]
            self.slots[sr.state_slot] = self.slots[sr.state_slot] + sr.token_ids
            if sr.sample:
                assert end == len(full)
                tok = next_token(full)
                result.sampled[sr.request_id] = tok
                result.logprobs[sr.request_id] = TokenLogprob(tok, -1.0, [])
        return result


def make_request(rid: str, prompt_len: int, max_tokens: int, rng: random.Random, **kw) -> Request:
    prompt = [rng.randrange(8, VOCAB) for _ in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), 0.0, eos_token_ids=frozenset())


def run_all(requests, cfg: SchedulerConfig, num_blocks: int, block_size: int, num_slots: int, max_steps=10_000,
            num_prefix_slots: int = 0, sched=None, runner=None, waves=None):
    """Run ``requests`` to completion (``waves``: lists of requests added one wave after another)."""
    sched = sched or Scheduler(cfg, HybridCacheManager(num_blocks, block_size, num_slots, num_prefix_slots))
    runner = runner or SimRunner(num_blocks, block_size, num_slots, num_prefix_slots)
    waves = waves or [requests]
    requests = [r for w in waves for r in w]
    for r in waves[0]:
        sched.add_request(r)
    waves = waves[1:]
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            if not waves:
                break
            for r in waves.pop(0):
                sched.add_request(r)
        plan = sched.schedule()
        assert not plan.is_empty, "scheduler stalled with unfinished requests"
        for out in sched.update(plan, runner.execute(plan, cfg)):
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if not sched.cache.prefix_caching:
            assert sched.cache.num_free_blocks + sum(len(r.block_ids) for r in sched.running) == num_blocks
    assert not sched.has_unfinished()
    assert sched.cache.num_reclaimable_blocks == num_blocks and sched.stats().cache_usage == 0.0
    sched.cache.clear_prefixes()
    assert sched.cache.num_free_blocks == num_blocks and sched.cache.num_free_slots == num_slots
    return outputs, reasons, sched


def expected_output(req: Request) -> list[int]:
    tokens = list(req.prompt_token_ids)
    out = []
    while len(out) < req.sampling.max_tokens:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in req.sampling.stop_token_ids:
            break
    return out
