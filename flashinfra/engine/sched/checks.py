"""Benchmarks of the scheduler, registered with ``flashinfra.feedback`` (no torch, no model).

``scheduler.decode.r256`` times one ``schedule()`` + ``update()`` round for 256 running requests in
decode, the per-step CPU cost the engine pays on top of the model; ``scheduler.prefill.r64`` the same
for 64 fresh requests prefilled in chunks, with prefix caching on.
"""

from __future__ import annotations

import random

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.engine.sched.plan import StepResult
from flashinfra.engine.sched.request import Request
from flashinfra.engine.sched.scheduler import Scheduler, SchedulerConfig
from flashinfra.feedback.registry import BenchContext, BenchSpec, register_benchmark


def _scheduler(num_requests: int, prompt_len: int, seed: int, prefix_slots: int) -> Scheduler:
    cfg = SchedulerConfig.from_engine(EngineConfig(max_num_seqs=num_requests, max_num_batched_tokens=8192), 4096)
    blocks = num_requests * (prompt_len + 64) // 16 + 1
    sched = Scheduler(cfg, HybridCacheManager(blocks, 16, num_requests, prefix_slots))
    rng = random.Random(seed)
    for i in range(num_requests):
        prompt = [rng.randrange(1, 150000) for _ in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True), 0.0))
    return sched


def _step(sched: Scheduler, tokens: list[int]):
    plan = sched.schedule()
    result = StepResult(sampled={sr.request_id: tokens[i % len(tokens)] for i, sr in enumerate(plan.scheduled)
                                 if sr.sample})
    outputs = sched.update(plan, result)
    return [sr.token_ids[-1] for sr in plan.scheduled], [o.new_token_ids for o in outputs]


@register_benchmark("scheduler.decode.r256", tags=("scheduler",))
def bench_decode(ctx: BenchContext) -> BenchSpec:
    n = 32 if ctx.quick else 256

    def make_inputs(seed: int):
        sched = _scheduler(n, 100, seed, 0)
        rng = random.Random(seed)
        tokens = [rng.randrange(1, 150000) for _ in range(n)]
        while any(r.num_output_tokens == 0 for r in sched.running) or sched.waiting:
            _step(sched, tokens)
        return sched, tokens

    return BenchSpec(fn=_step, make_inputs=make_inputs, description=f"schedule + update, {n} requests in decode",
                     params={"requests": n})


@register_benchmark("scheduler.prefill.r64", tags=("scheduler",))
def bench_prefill(ctx: BenchContext) -> BenchSpec:
    n = 16 if ctx.quick else 64

    def make_inputs(seed: int):
        rng = random.Random(seed)
        return _scheduler(n, 500, seed, n), [rng.randrange(1, 150000) for _ in range(n)]

    return BenchSpec(fn=_step, make_inputs=make_inputs,
                     description=f"schedule + update, first chunk of {n} 500-token prompts", params={"requests": n})
