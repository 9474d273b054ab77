"""Host overhead of a decode step (issue #40): synchronous against asynchronous scheduling, built-in model.

For each batch size and mode the engine decodes ``batch`` requests (32-token prompts) and times ``--steps``
steady decode steps: the step's wall time (between two ``EngineCore.step`` returns) and its host time, what the
CPU spends scheduling (``Scheduler.schedule``) and preparing and launching (``ModelRunner.launch``: the packed
input copy, the forward pass's launches, sampling's launches), with its parts: schedule, prepare (the inputs packed
and copied, ``ModelRunner._upload``) and update (``Scheduler.update``, after the step). Synchronously the device idles
through the host time of every step; with ``--async-scheduling`` the host prepares step N+1 while the device runs
step N, so the wall time tends to max(host, device) instead of host + device. On a CPU the "device" is the same cores
and ``launch`` computes the whole step: there only the parts (schedule, prepare, update) are host overhead, and
nothing overlaps.

    python bench/host_overhead.py --device cpu --dtype float32                 # bench/results/host_overhead_cpu.json
    python bench/host_overhead.py --device cuda --out $OUT/host_overhead.json  # the H200 (bench/README.md)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PROMPT_LEN = 32


def timed(obj, name: str, sink: list[float]) -> None:
    """Wrap ``obj.name`` so that each call adds its seconds to ``sink``."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def measure(config, model, batch: int, steps: int, warmup: int) -> dict:
    from flashinfra.engine.core import EngineCore
    from flashinfra.engine.sched.messages import EngineRequest, SamplingParams
    from flashinfra.feedback.bench import summarize_times
    from flashinfra.feedback.timing import checked_step

    core = EngineCore(config, model=model)
    params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(PROMPT_LEN)]
        core.add_request(EngineRequest(f"b{i}", prompt, params, time.time()))
    schedule_s: list[float] = []
    launch_s: list[float] = []
    prepare_s: list[float] = []
    update_s: list[float] = []
    timed(core.scheduler, "schedule", schedule_s)
    timed(core.runner, "launch", launch_s)
    timed(core.runner, "_upload", prepare_s)  # inside launch: the inputs packed and copied
    timed(core.scheduler, "update", update_s)
    sync = _sync(config.device)
    while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()) or core.scheduler.waiting:
        checked_step(core)  # prefill
    for _ in range(warmup):
        checked_step(core)
    sync()
    walls, hosts, parts = [], [], {"schedule": [], "prepare": [], "update": []}
    last = time.perf_counter()
    for _ in range(steps):
        for sink in (schedule_s, launch_s, prepare_s, update_s):
            del sink[:]
        checked_step(core)
        now = time.perf_counter()
        walls.append(now - last)
        hosts.append(sum(schedule_s) + sum(launch_s))
        for name, sink in (("schedule", schedule_s), ("prepare", prepare_s), ("update", update_s)):
            parts[name].append(sum(sink))
        last = now
    sync()
    row = {"batch": batch, "async_scheduling": config.async_scheduling,
           "step_wall": summarize_times(walls), "host": summarize_times(hosts),
           **{name: summarize_times(v) for name, v in parts.items()},
           "host_fraction_median": sorted(h / w for h, w in zip(hosts, walls))[len(walls) // 2]}
    core.close()
    del core
    gc.collect()  # the engine's graphs and cache go before the next engine captures its own
    if config.device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    return row


def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="results JSON (default: bench/results/host_overhead[_cpu].json)")
    args = ap.parse_args()

    import torch

    from flashinfra.engine.config import EngineConfig
    from flashinfra.feedback import timing

    base = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=max(args.batches),
                        max_num_batched_tokens=max(args.batches) * PROMPT_LEN, prefix_cache_slots=0).resolved()
    model = None
    rows = []
    for batch in args.batches:
        for mode in (False, True):
            config = EngineConfig(**{**vars(base), "async_scheduling": mode})
            if model is None:
                from flashinfra.engine.core import EngineCore

                model = EngineCore(config).model
            row = measure(config, model, batch, args.steps, args.warmup)
            rows.append(row)
            ms = {k: row[k]["median_s"] * 1e3 for k in ("step_wall", "host", "schedule", "prepare", "update")}
            print(f"batch {batch:3d} {'async' if mode else 'sync '}: step {ms['step_wall']:8.3f} ms  host "
                  f"{ms['host']:8.3f} ms (schedule {ms['schedule']:.3f}, prepare {ms['prepare']:.3f}, update "
                  f"{ms['update']:.3f})", flush=True)
    label = "cpu" if base.device == "cpu" else base.device
    results = {**timing.header(), "label": label, "dtype": base.dtype, "model": "built-in default model",
               "prompt_len": PROMPT_LEN, "steps": args.steps, "torch_threads": torch.get_num_threads(), "rows": rows}
    name = "host_overhead_cpu" if label == "cpu" else "host_overhead"
    if args.out:
        out = Path(args.out)
        path = timing.write_results(out.stem, results, directory=out.parent)
    else:
        path = timing.write_results(name, results)
    print(path)


if __name__ == "__main__":
    main()
