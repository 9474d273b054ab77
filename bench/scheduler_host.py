"""Host time of the scheduler and the cache manager, without a model: each step's ``Scheduler.schedule`` and
``update``. Two cases:

- ``long``: a 1M-token prompt as the slice's long row configures the engine (one sequence, an 8,192-token budget,
  16-token blocks, the prefix cache's checkpoints every 1,024 tokens), then its decode steps. Checkpointed steps run
  synchronously, so this host time adds to the prompt's TTFT.
- ``decode``: 128 requests decoding together (256-token prompts, 128 output tokens), as a loaded server's steps,
  with two more arriving every other step; the median of 200 steady steps. With asynchronous scheduling this host
  time runs beside the device's step, and bounds it where it is longer.

    python3 bench/scheduler_host.py --case long --out bench/results/scheduler_host_long.json
    PYTHONPATH=OTHER_TREE python3 bench/scheduler_host.py ...   # another revision's flashinfra
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.sched.aligned import KDA_CHUNK
from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.engine.sched.plan import StepResult
from flashinfra.engine.sched.request import Request
from flashinfra.engine.sched.scheduler import Scheduler
from flashinfra.engine.sched.scheduler_config import SchedulerConfig
from flashinfra.feedback.timing import header, write_results

PROMPT, DECODE, BUDGET = 1_048_544, 32, 8192


def _scheduler(max_num_seqs: int, max_len: int, blocks: int) -> Scheduler:
    cfg = EngineConfig(device="cpu", max_num_seqs=max_num_seqs, max_model_len=max_len, max_num_batched_tokens=BUDGET)
    return Scheduler(SchedulerConfig.from_engine(cfg, max_len),
                     HybridCacheManager(blocks, cfg.block_size, cfg.max_num_seqs, cfg.resolved_prefix_slots,
                                        cfg.prefix_checkpoint_interval, chunk=KDA_CHUNK))


def _add(sched: Scheduler, rid: str, prompt: int, outputs: int, rng: random.Random) -> None:
    ids = [rng.randrange(1, 150_000) for _ in range(prompt)]
    sched.add_request(Request(rid, ids, SamplingParams(max_tokens=outputs, temperature=0.0, ignore_eos=True),
                              time.time()))


def _step(sched: Scheduler) -> dict:
    """One step, every sampled row given a token: schedule and update milliseconds, rows and tokens."""
    t0 = time.perf_counter()
    plan = sched.schedule()
    t1 = time.perf_counter()
    sched.update(plan, StepResult(sampled={sr.request_id: 7 for sr in plan.scheduled if sr.sample}))
    return dict(schedule_ms=(t1 - t0) * 1e3, update_ms=(time.perf_counter() - t1) * 1e3, rows=len(plan.scheduled),
                tokens=sum(sr.num_new_tokens for sr in plan.scheduled))


def long_case() -> dict:
    max_len = PROMPT + 2 * DECODE
    sched = _scheduler(1, max_len, -(-max_len // 16))
    _add(sched, "r", PROMPT, DECODE + 1, random.Random(0))
    steps = []
    while sched.has_unfinished():
        steps.append(_step(sched))
    prompt = [s for s in steps if s["tokens"] > 1]
    return dict(steps=steps, prompt_steps=len(prompt),
                prompt_host_ms=sum(s["schedule_ms"] + s["update_ms"] for s in prompt),
                late_step_host_ms=statistics.median(s["schedule_ms"] + s["update_ms"] for s in prompt[-8:]),
                first_step_host_ms=prompt[0]["schedule_ms"] + prompt[0]["update_ms"])


def decode_case(rows: int = 128, steady: int = 200) -> dict:
    rng = random.Random(0)
    sched = _scheduler(rows, 4096, rows * 64)
    for i in range(rows):
        _add(sched, f"r{i}", 256, 128, rng)
    steps = []
    for i in range(2 * steady):
        if i % 2 == 0:
            for j in range(2):
                _add(sched, f"n{i}.{j}", 256, 128, rng)
        steps.append(_step(sched))
    late = steps[steady:]
    return dict(steps=late, rows=statistics.median(s["rows"] for s in late),
                step_host_ms=statistics.median(s["schedule_ms"] + s["update_ms"] for s in late),
                schedule_ms=statistics.median(s["schedule_ms"] for s in late),
                update_ms=statistics.median(s["update_ms"] for s in late))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("long", "decode"), default="long")
    ap.add_argument("--out", default=None, help="default: bench/results/scheduler_host_CASE.json")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the case; the one of least host time is kept")
    args = ap.parse_args()
    report = header()
    runs = [long_case() if args.case == "long" else decode_case() for _ in range(args.repeats)]
    key = "prompt_host_ms" if args.case == "long" else "step_host_ms"
    report.update(min(runs, key=lambda r: r[key]), repeats=[r[key] for r in runs])
    out = Path(args.out or f"bench/results/scheduler_host_{args.case}.json")
    write_results(out.stem, report, directory=out.parent)
    if args.case == "long":
        print(f"{report['prompt_steps']} prompt steps: host {report['prompt_host_ms']:.0f} ms in all, the first "
              f"{report['first_step_host_ms']:.1f} ms, late steps {report['late_step_host_ms']:.2f} ms each")
    else:
        print(f"{report['rows']:.0f} rows a step: host {report['step_host_ms']:.2f} ms a step (schedule "
              f"{report['schedule_ms']:.2f}, update {report['update_ms']:.2f})")


if __name__ == "__main__":
    main()

