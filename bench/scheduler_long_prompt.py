"""Host time of the scheduler and the cache manager over a 1M-token prompt, without a model: each step's
``Scheduler.schedule`` and ``update`` (the prefix cache's checkpoints every 1,024 tokens included) as the slice's
long row configures them (one sequence, an 8,192-token budget, 16-token blocks), then the decode steps. With
checkpoints in a step, the engine runs it synchronously, so this host time adds to the prompt's TTFT.

    python3 bench/scheduler_long_prompt.py --out bench/results/scheduler_long_prompt.json
    PYTHONPATH=OTHER_TREE python3 bench/scheduler_long_prompt.py ...   # another revision's flashinfra
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


def run() -> list[dict]:
    """Per step: schedule and update seconds, and the tokens it scheduled."""
    max_len = PROMPT + 2 * DECODE
    cfg = EngineConfig(device="cpu", max_num_seqs=1, max_model_len=max_len, max_num_batched_tokens=BUDGET)
    blocks = -(-max_len // cfg.block_size)
    sched = Scheduler(SchedulerConfig.from_engine(cfg, max_len),
                      HybridCacheManager(blocks, cfg.block_size, cfg.max_num_seqs, cfg.resolved_prefix_slots,
                                         cfg.prefix_checkpoint_interval, chunk=KDA_CHUNK))
    rng = random.Random(0)
    ids = [rng.randrange(1, 150_000) for _ in range(PROMPT)]
    sched.add_request(Request("r", ids, SamplingParams(max_tokens=DECODE + 1, temperature=0.0, ignore_eos=True),
                              time.time()))
    steps = []
    while sched.has_unfinished():
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        result = StepResult(sampled={sr.request_id: 7 for sr in plan.scheduled
                                     if sr.context_len + sr.num_new_tokens >= len(sr.prompt_token_ids)})
        sched.update(plan, result)
        steps.append(dict(schedule_ms=(t1 - t0) * 1e3, update_ms=(time.perf_counter() - t1) * 1e3,
                          tokens=sum(sr.num_new_tokens for sr in plan.scheduled)))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/scheduler_long_prompt.json")
    args = ap.parse_args()
    report = header()
    steps = run()
    prompt = [s for s in steps if s["tokens"] > 1]
    late = prompt[-8:]
    report.update(steps=steps, prompt_steps=len(prompt),
                  prompt_host_ms=sum(s["schedule_ms"] + s["update_ms"] for s in prompt),
                  late_step_host_ms=statistics.median(s["schedule_ms"] + s["update_ms"] for s in late),
                  first_step_host_ms=prompt[0]["schedule_ms"] + prompt[0]["update_ms"])
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)
    print(f"{len(prompt)} prompt steps: host {report['prompt_host_ms']:.0f} ms in all, the first "
          f"{report['first_step_host_ms']:.1f} ms, late steps {report['late_step_host_ms']:.2f} ms each")


if __name__ == "__main__":
    main()
