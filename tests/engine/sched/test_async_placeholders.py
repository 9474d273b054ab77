"""Asynchronous scheduling at the scheduler level: steps scheduled one ahead with placeholder tokens give the
outputs of synchronous steps (stops found one step late, the extra token discarded), every block and slot is
free at the end, and a step ahead never preempts."""

from __future__ import annotations

import random

import pytest

from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.plan import PLACEHOLDER_TOKEN, Plan, StepResult
from flashinfra.engine.sched.scheduler import Scheduler

from tests.engine.sched.sim import expected_output, make_request, next_token, sched_config


class AheadRunner:
    """Feeds a placeholder the token the previous step sampled for its request (as the runner does on the device)
    and checks that each request's fed tokens are exactly its sequence, in order."""

    def __init__(self) -> None:
        self.fed: dict[str, list[int]] = {}

    def execute(self, plan: Plan, prev: StepResult | None) -> StepResult:
        result = StepResult()
        for sr in plan.scheduled:
            tokens = list(sr.token_ids)
            assert PLACEHOLDER_TOKEN not in tokens[:-1]
            if tokens[-1] == PLACEHOLDER_TOKEN:
                tokens[-1] = prev.sampled[sr.request_id]
            fed = self.fed.setdefault(sr.request_id, [])
            if sr.context_len == 0:
                fed.clear()  # fresh, or recomputed after a preemption
            assert len(fed) == sr.context_len
            fed.extend(tokens)
            if sr.sample:
                result.sampled[sr.request_id] = next_token(fed)
        return result


def run(sched: Scheduler, requests, abort_at: dict[str, int] | None = None):
    """Drive ``sched`` as ``EngineCore.step`` does; outputs per request and the number of steps run ahead."""
    runner, outputs, ahead_steps = AheadRunner(), {r.request_id: [] for r in requests}, 0
    abort_at = abort_at or {}
    for r in requests:
        sched.add_request(r)
    inflight = None
    for _ in range(10_000):
        if inflight is None:
            if not sched.has_unfinished():
                break
            plan = sched.schedule()
            inflight = (plan, runner.execute(plan, None))
        (plan, result), inflight = inflight, None
        if sched.can_schedule_ahead(plan):
            ahead = sched.schedule(ahead=True)
            if ahead is not None:
                inflight, ahead_steps = (ahead, runner.execute(ahead, result)), ahead_steps + 1
        for out in sched.update(plan, result):
            outputs[out.request_id] += out.new_token_ids
            if not out.finished and len(outputs[out.request_id]) == abort_at.get(out.request_id):
                sched.abort([out.request_id])
    return outputs, ahead_steps


@pytest.mark.parametrize("num_blocks", [400, 24])
def test_steps_ahead_match_synchronous_outputs_and_free_everything(num_blocks):
    rng = random.Random(num_blocks)
    requests = [make_request(f"r{i}", rng.randrange(1, 40), rng.randrange(1, 12), rng,
                             stop_token_ids=tuple(range(0, 1000, 9)), temperature=0.0) for i in range(12)]
    cfg = sched_config(4096, max_num_seqs=6, max_num_batched_tokens=24, max_prefill_chunk=10, async_scheduling=True)
    sched = Scheduler(cfg, HybridCacheManager(num_blocks, 4, 6))
    outputs, ahead_steps = run(sched, requests)
    assert ahead_steps > 0
    assert outputs == {r.request_id: expected_output(r) for r in requests}
    assert any(len(outputs[r.request_id]) < r.sampling.max_tokens for r in requests)  # stopped by a token
    if num_blocks == 24:
        assert sched.num_preemptions_total > 0
    assert not sched.has_unfinished() and not sched.requests
    assert all(r.num_output_placeholders == 0 or r.is_finished for r in requests)
    assert sched.cache.num_free_blocks == num_blocks and sched.cache.num_free_slots == 6


def test_aborts_between_steps_free_everything():
    rng = random.Random(3)
    requests = [make_request(f"r{i}", rng.randrange(1, 20), 10, rng, temperature=0.0) for i in range(5)]
    cfg = sched_config(4096, max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=True)
    sched = Scheduler(cfg, HybridCacheManager(100, 4, 8))
    outputs, _ = run(sched, requests, abort_at={"r0": 1, "r3": 4})
    assert len(outputs["r0"]) == 1 and len(outputs["r3"]) == 4
    assert outputs["r1"] == expected_output(requests[1])
    assert sched.cache.num_free_blocks == 100 and sched.cache.num_free_slots == 8 and not sched.requests


def test_a_step_ahead_never_preempts():
    rng = random.Random(4)
    cfg = sched_config(4096, max_num_seqs=4, max_num_batched_tokens=64, async_scheduling=True)
    sched = Scheduler(cfg, HybridCacheManager(6, 4, 4))
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 12, 20, rng, temperature=0.0))
    plan = sched.schedule()  # 12 tokens each: all six blocks, none for the 13th
    assert sched.can_schedule_ahead(plan)
    assert sched.schedule(ahead=True) is None and sched.num_preemptions_total == 0
    runner = AheadRunner()
    sched.update(plan, runner.execute(plan, None))
    assert sched.schedule().preempted_ids  # the synchronous step preempts
