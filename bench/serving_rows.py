"""Rows of the serving table (bench/README.md) measured through ``EngineCore``, as functions that a table script
imports, each taking an ``engine_factory`` so that the caller chooses the model and the engine options.

- ``prefill_row``: one long prompt, one request, from ``add_request`` until its first token is sampled: the
  engine steps that took and the wall time. Each run uses a fresh random prompt, so no run hits the prefix
  cache that an earlier one filled, while every run still saves its own prompt's checkpoints (the prefix cache
  stays on, as in serving). ``prefill_8k_row`` is the table's row: 8000 tokens, goal 70 ms.
- ``slice_engine_factory``: engines on the 4-layer full-width slice of bench/hotpath_slice.py (3 KDA layers,
  1 MLA/DSA layer, 288-expert MoE, mHC; random bf16 weights), the model loaded once and shared.

Run alone: ``python bench/serving_rows.py --out bench/results/serving_prefill.json`` on a GPU; ``--smoke`` runs
the same code at toy width on the CPU (reference ops), to check it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams
from flashinfra.feedback.timing import checked_step

PREFILL_8K_TOKENS = 8000
PREFILL_8K_GOAL_MS = 70.0


def _sync(engine: EngineCore) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def _prefill_once(engine: EngineCore, prompt: list[int], request_id: str) -> tuple[float, int]:
    """Seconds and engine steps from adding ``prompt`` (one output token) until the engine is idle."""
    _sync(engine)
    start = time.perf_counter()
    engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True), time.time()))
    steps = 0
    while engine.has_unfinished():
        checked_step(engine)
        steps += 1
    _sync(engine)
    return time.perf_counter() - start, steps


def prefill_row(engine_factory: Callable[[], EngineCore], tokens: int, reps: int = 5, warmup: int = 2,
                goal_ms: float | None = None, seed: int = 0) -> dict:
    """One ``tokens``-token prompt, one request, through ``engine_factory()``'s ``EngineCore``.

    ``engine_factory``: takes no argument and returns an engine whose token budget
    (``max_num_batched_tokens``) and ``max_model_len`` admit the prompt; it is called once, and the engine runs
    ``warmup`` untimed prompts (kernel compilation) and then ``reps`` timed ones, each a fresh random prompt.
    Returns ``tokens``, ``steps`` (engine steps per prompt; 1 when only the token budget cuts a step),
    ``ms`` (median), ``times_ms``, ``tokens_per_s``, ``checkpoints`` (prefix checkpoints the last prompt
    registered), the engine options that matter here, and with ``goal_ms`` the goal and ``meets_goal``."""
    engine = engine_factory()
    rng = random.Random(seed)
    vocab = engine.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(tokens)]

    for i in range(warmup):
        _prefill_once(engine, prompt(), f"warmup-{i}")
    times, steps = [], []
    for i in range(reps):
        cached = engine.scheduler.cache.num_cached_prefixes
        s, n = _prefill_once(engine, prompt(), f"prefill-{i}")
        times.append(s * 1e3)
        steps.append(n)
    ms = statistics.median(times)
    cfg = engine.config
    row = dict(tokens=tokens, steps=max(steps), ms=ms, times_ms=times, tokens_per_s=tokens / ms * 1e3,
               checkpoints=engine.scheduler.cache.num_cached_prefixes - cached,
               engine=dict(block_size=cfg.block_size, max_num_batched_tokens=cfg.max_num_batched_tokens,
                           prefix_cache_slots=cfg.resolved_prefix_slots,
                           prefix_checkpoint_interval=cfg.prefix_checkpoint_interval))
    if goal_ms is not None:
        row.update(goal_ms=goal_ms, meets_goal=ms <= goal_ms)
    return row


def prefill_8k_row(engine_factory: Callable[[], EngineCore], reps: int = 5) -> dict:
    """The table's prefill row: an 8000-token prompt, one request (``prefill_row``), against the 70 ms goal.
    ``engine_factory`` as for ``prefill_row``; ``slice_engine_factory()`` gives the table's engine."""
    return prefill_row(engine_factory, PREFILL_8K_TOKENS, reps=reps, goal_ms=PREFILL_8K_GOAL_MS)


def slice_engine_factory(smoke: bool = False, max_num_batched_tokens: int = 8192, **engine_options
                         ) -> Callable[[], EngineCore]:
    """A factory of engines on the 4-layer full-width slice (bench/hotpath_slice.py: ``slice_config`` and its
    random release-format weights, bf16 on the GPU); the model is built at the first call and shared by later
    ones. ``smoke``: the toy-width slice in float32 on the CPU. ``engine_options``: more ``EngineConfig``
    fields."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hotpath_slice
    from flashinfra.model.api import random_model

    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    hotpath_slice.DEV = device
    loaded = []

    def factory() -> EngineCore:
        if not loaded:
            loaded.append(random_model(hotpath_slice.slice_config(smoke), dtype, device))
        config = EngineConfig(device=device, dtype="float32" if smoke else "bfloat16",
                              max_num_batched_tokens=max_num_batched_tokens, **engine_options)
        return EngineCore(config, model=loaded[0])

    return factory


def main() -> None:
    from flashinfra.feedback.timing import header, write_results

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serving_prefill.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU, a short prompt, to check the script")
    args = ap.parse_args()
    report = header()
    report["arguments"] = vars(args)
    if args.smoke:
        report["device"] += " (smoke)"
        report["prefill"] = prefill_row(slice_engine_factory(smoke=True, max_num_batched_tokens=512), 300,
                                        reps=args.reps, warmup=1)
    else:
        report["prefill_8k"] = prefill_8k_row(slice_engine_factory(), reps=args.reps)
    out = Path(args.out)
    print(write_results(out.stem, report, directory=out.parent))
    print({k: v for k, v in report.items() if k.startswith("prefill")})


if __name__ == "__main__":
    main()
