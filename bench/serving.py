"""Serving at the speed of the kernels: every row of issue #40's table, ours against its floor, in one run.

The slice is ``bench/hotpath_slice.py``'s (4 layers at full width, random bf16 weights, built from
release-format tensors), driven through ``EngineCore`` in this process as a user's engine would run it;
each engine step is timed on the host (a step returns sampled tokens, so it ends synchronised). Rows:

- ``prefill_8k``: an 8000-token prompt, one request (TTFT and steps); floor: the slice's kernel-only
  8192-token prefill (``hotpath_slice.prefill``). ``bench/serving_rows.py``'s ``prefill_8k_row`` is used when present.
- ``decode_4k``: the median engine step of one request decoding at 4k context; floor: weight and cache
  bytes the step reads / copy bandwidth (``hotpath_slice.decode``).
- ``new_shapes``: a fresh engine (start-up warm-up time and memory), then the first steps at batch 32, at
  batch 128 and of a first 4k prompt; max step / steady-state step (goal: at most 2).
- ``--long`` only (minutes, memory checked first): a 1,048,544-token prompt (TTFT, every prefill step, late ones;
  floor: prefill FLOPs / bf16 matmul rate) and decode at that context (floor as ``decode_4k``'s).
- ``server``: ``flashinfra serve`` with the built-in model, ``bench serve`` at concurrency 1/16/64/128;
  floor: the same API server in front of an engine that computes nothing (``bench/serving_server.py``).

usage: python bench/serving.py [--long] [--out bench/results/serving.json]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
from hotpath_slice import cache_bytes, decode, free_memory, prefill, prefill_flops, slice_config
from serving_server import server_rows

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams
from flashinfra.feedback import ceilings
from flashinfra.feedback.compiles import CompileWatch, KeptCompiles
from flashinfra.feedback.timing import checked_step, header, write_results
from flashinfra.model.api import random_model
from flashinfra.model.cache import ModelCache

PROMPT_8K, CONTEXT_4K, PROMPT_1M = 8000, 4096, 1_048_544
BUDGET = 8192  # the engine's token budget per step
DECODE_STEPS = 32
LONG_SEQS = 1  # the 1M engine holds one sequence (and its prefix-cache checkpoint slot)
LONG_HEADROOM_BYTES = 16 * 2**30  # activations of a budget-sized prefill step and the warm-up's graphs
SHORT_CACHE_BYTES = 8 * 2**30


def engine(lm, max_model_len: int, cache_bytes_budget: int, max_num_seqs: int = 128,
           async_scheduling: bool | None = None) -> tuple[EngineCore, float]:
    """A fresh engine on the loaded slice (its start-up warm-up included); returns it and its start-up time."""
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=BUDGET, kv_cache_memory=cache_bytes_budget,
                          async_scheduling=async_scheduling)
    start = time.perf_counter()
    core = EngineCore(config, model=lm)
    return core, time.perf_counter() - start


def add(core: EngineCore, prompt_len: int, max_tokens: int, seed: int) -> str:
    """Queue one greedy request of random tokens (a fresh seed, used once per engine: no prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    rid = f"r{seed}"
    ids = torch.randint(1, core.vocab_size, (prompt_len,), generator=g).tolist()
    core.add_request(EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True), time.time()))
    return rid


def run_steps(core: EngineCore, prefill_marked: bool = False, slowest: dict | None = None,
              profile_from: int = 0) -> list[tuple]:
    """Step until idle; per step: (seconds, tokens it sampled), and with ``prefill_marked`` whether it gave some
    request its first token (a step that ran a prompt). With ``slowest`` (a dict), each step from the
    ``profile_from``-th on runs under cProfile and the slowest one's largest functions by cumulative time are left in
    it (``profile_rows``)."""
    steps, started = [], set()
    while core.has_work():
        prof = cProfile.Profile() if slowest is not None and len(steps) >= profile_from else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        outputs = checked_step(core)
        dt = time.perf_counter() - t
        if prof is not None:
            prof.disable()
            if dt > slowest.get("seconds", 0.0):
                slowest.update(step=len(steps), seconds=dt, functions=profile_rows(prof))
        new = {o.request_id for o in outputs if o.new_token_ids} - started
        started |= new
        n = sum(len(o.new_token_ids) for o in outputs)
        steps.append((dt, n, bool(new)) if prefill_marked else (dt, n))
    return steps


def profile_rows(prof: cProfile.Profile, n: int = 30) -> list[dict]:
    """The ``n`` functions of a profile with the most cumulative time: where, calls, cumulative and own seconds."""
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:n]
    return [dict(function=f"{Path(file).name}:{line}({name})", calls=nc, cumulative_s=round(ct, 6), own_s=round(tt, 6))
            for (file, line, name), (_, nc, tt, ct, _) in rows]


def prefill_row(core: EngineCore, tokens: int, seed: int) -> dict:
    """One request of ``tokens`` prompt tokens and one output token, after an untimed one of the same size."""
    add(core, tokens, 1, seed)
    run_steps(core)
    add(core, tokens, 1, seed + 1)
    steps = run_steps(core)
    return dict(tokens=tokens, ttft_s=sum(s for s, _ in steps), steps=len(steps), step_s=[s for s, _ in steps])


def decode_row(core: EngineCore, context: int, seed: int) -> dict:
    """Median engine step of one request decoding after a ``context``-token prompt."""
    add(core, context, DECODE_STEPS + 1, seed)
    steps = run_steps(core)
    decode_steps = [s for s, _ in steps[-DECODE_STEPS:]]
    return dict(context=context, batch=1, median_step_s=statistics.median(decode_steps),
                max_step_s=max(decode_steps), steps=decode_steps)


def batch_shape_row(core: EngineCore, batch: int, seed: int) -> dict:
    """``batch`` requests of 256-token prompts decoding together for the first time, then a second such batch: the
    first batch's prefill step against the second's (the same shape again), its first decode steps against the
    steady ones, and the kernels that compiled on the way. The row's ratio is the larger of the two."""
    compiled, parts = KeptCompiles(), []
    for again in (0, 1):
        for i in range(batch):
            add(core, 256, 24, seed + 1000 * again + i)
        watch = CompileWatch(compiled).start()  # what the warm-up left to serving
        try:
            parts.append(run_steps(core, prefill_marked=True))
        finally:
            watch.stop()
    (first, second) = parts
    prefill = [s for s, _, new in first if new]
    decode = [s for s, n, new in first if not new and n == batch]
    steady = statistics.median(decode[len(decode) // 2:])
    prefill_again = sum(s for s, _, new in second if new)
    ratio = max(max(decode[: len(decode) // 2]) / steady, sum(prefill) / prefill_again)
    return dict(batch=batch, prefill_s=sum(prefill), prefill_again_s=prefill_again, max_decode_step_s=max(decode),
                steady_step_s=steady, max_step_s=max(max(decode), sum(prefill)), ratio=ratio,
                steps=[s for s, _, _ in first], compiled_kernels=[f"{e['kernel']}: {e['spec']}" for e in compiled])


def first_prompt_row(core: EngineCore, tokens: int, seed: int) -> dict:
    """The first prompt of ``tokens`` tokens against a second one of the same length."""
    first = run_steps_after(core, tokens, seed)
    second = run_steps_after(core, tokens, seed + 1)
    return dict(tokens=tokens, max_step_s=max(first), steady_step_s=max(second), ratio=max(first) / max(second),
                first_steps=first, second_steps=second)


def run_steps_after(core: EngineCore, tokens: int, seed: int) -> list[float]:
    add(core, tokens, 1, seed)
    return [s for s, _ in run_steps(core)]


def long_rows(lm, ceil: dict, weight_only_bytes: int, profile: bool = False, sync: bool = False) -> dict:
    """The 1M-token prompt and decode at 1M context, if the device holds the cache; with ``profile``, the steps
    from the prompt's last chunks on under cProfile and the slowest one's functions kept (``slowest_step``; the
    profiler's own cost slows the steps); with ``sync``, asynchronous scheduling off (each step's time is then its
    own device time)."""
    cfg = lm.config.text
    max_len, slots = PROMPT_1M + 2 * DECODE_STEPS, 2 * LONG_SEQS
    blocks = -(-max_len // EngineConfig.block_size) * LONG_SEQS
    need = (blocks * ModelCache.bytes_per_block(cfg, EngineConfig.block_size, lm.dtype, lm.latent_dtypes())
            + slots * ModelCache.bytes_per_slot(cfg, lm.dtype, lm.cache_spec.state_dtype))
    free, _ = torch.cuda.mem_get_info()
    if free < need + LONG_HEADROOM_BYTES:
        return dict(skipped=f"needs about {(need + LONG_HEADROOM_BYTES) / 2**30:.1f} GiB free, "
                            f"{free / 2**30:.1f} GiB are")
    core, startup = engine(lm, max_len, need, max_num_seqs=LONG_SEQS, async_scheduling=False if sync else None)
    add(core, PROMPT_1M, DECODE_STEPS + 1, 7)
    compiled = KeptCompiles()
    watch = CompileWatch(compiled).start()  # what the warm-up left to the long prompt
    slowest = {} if profile else None
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    try:
        # the profiler's cost on every one of the prompt's steps would take minutes: its last chunks and the decode
        steps = run_steps(core, slowest=slowest, profile_from=-(-PROMPT_1M // BUDGET) - 2)
    finally:
        watch.stop()
    # allocations that found the device full: the caching allocator then frees its cache and waits for the device
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    prefill_steps = [s for s, _ in steps[:-DECODE_STEPS]]
    decode_steps = [s for s, _ in steps[-DECODE_STEPS:]]
    flops = prefill_flops(lm, PROMPT_1M)
    floor_prefill = flops / ceil["matmul_flops_per_s_bfloat16"]
    ttft = sum(prefill_steps)
    late = prefill_steps[-8:]
    decode_bytes = weight_only_bytes + cache_bytes(cfg, PROMPT_1M, 1)
    floor_decode = decode_bytes / ceil["copy_bytes_per_s"]
    out = dict(startup_s=startup, warmup=_warmup(core),
               prefill_1m=dict(tokens=PROMPT_1M, ttft_s=ttft, tok_s=PROMPT_1M / ttft, steps=len(prefill_steps),
                               late_step_median_s=statistics.median(late), floor_s=floor_prefill, flops=flops,
                               ratio=ttft / floor_prefill, first_step_s=prefill_steps[0],
                               step_s=[round(s, 5) for s in prefill_steps]),
               decode_1m=dict(median_step_s=statistics.median(decode_steps), floor_s=floor_decode,
                              bytes=decode_bytes, ratio=statistics.median(decode_steps) / floor_decode,
                              steps=decode_steps),
               compiled_kernels=[dict(kernel=e["kernel"], spec=e["spec"], seconds=e["duration_s"]) for e in compiled])
    out["alloc_retries"] = retries
    if slowest is not None:
        out["slowest_step"] = slowest
    del core
    free_memory()
    return out


def _warmup(core: EngineCore) -> dict | None:
    w = core.warmup
    return None if w is None else dict(seconds=w.seconds, graphs=w.graphs_captured, memory_bytes=w.memory_bytes,
                                       peak_bytes=w.peak_bytes, prefill_shapes=w.prefill_shapes)


def _prefill_8k(lm, core: EngineCore) -> dict:
    """``bench/serving_rows.py``'s row when it exists (the same measurement, on an engine of this script's
    options), else this script's on ``core``."""
    try:
        from serving_rows import prefill_8k_row
    except ImportError:
        return dict(source="bench/serving.py", **prefill_row(core, PROMPT_8K, 1))
    try:
        row = prefill_8k_row(lambda: engine(lm, 16384, SHORT_CACHE_BYTES)[0])
        return dict(source="bench/serving_rows.py", ttft_s=row["ms"] / 1e3, **row)
    except Exception as exc:  # noqa: BLE001 -- one GPU call must still produce every other row
        return dict(source=f"bench/serving.py (serving_rows.prefill_8k_row failed: {exc})",
                    **prefill_row(core, PROMPT_8K, 1))


def short_rows(lm, rows: dict, kernel_prefill: dict, kernel_decode: dict) -> None:
    """The rows of one engine at short context: new shapes after start-up, the 8k prompt, decode at 4k."""
    core, startup = engine(lm, 16384, SHORT_CACHE_BYTES)
    rows["new_shapes"] = dict(startup_s=startup, warmup=_warmup(core),
                              batch_32=batch_shape_row(core, 32, 100), batch_128=batch_shape_row(core, 128, 200),
                              first_4k_prompt=first_prompt_row(core, CONTEXT_4K, 400))
    print("new shapes", {k: v.get("ratio") for k, v in rows["new_shapes"].items() if isinstance(v, dict)}, flush=True)
    rows["prefill_8k"] = dict(_prefill_8k(lm, core), floor_s=kernel_prefill["median_s"],
                              floor_source="kernel-only 8192-token prefill (hotpath_slice.prefill)")
    rows["decode_4k"] = dict(decode_row(core, CONTEXT_4K, 500), floor_s=kernel_decode["floor_s"],
                             kernel_graph_step_s=kernel_decode["graph_median_s"])
    print("prefill_8k", rows["prefill_8k"]["ttft_s"], "decode_4k", rows["decode_4k"]["median_step_s"], flush=True)
    del core
    free_memory()


def table(report: dict) -> list[str]:
    rows = report["rows"]

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.2f} ms"

    lines = ["| what | ours | floor | ours / floor |", "| --- | --- | --- | --- |"]
    if "prefill_8k" in rows:
        p, d, n = rows["prefill_8k"], rows["decode_4k"], rows["new_shapes"]
        lines.append(f"| 8000-token prompt, slice | {ms(p.get('ttft_s'))} in {p.get('steps', '?')} steps "
                     f"| {ms(p['floor_s'])} | {p['ttft_s'] / p['floor_s'] if 'ttft_s' in p else float('nan'):.2f} |")
        lines.append(f"| decode step, batch 1, 4k, slice | {ms(d['median_step_s'])} | {ms(d['floor_s'])} "
                     f"| {d['median_step_s'] / d['floor_s']:.2f} |")
        for key in ("batch_32", "batch_128", "first_4k_prompt"):
            r = n[key]
            first = (f"prefill {ms(r['prefill_s'])} (again {ms(r['prefill_again_s'])}), decode max "
                     f"{ms(r['max_decode_step_s'])}" if "prefill_s" in r else f"max {ms(r['max_step_s'])}")
            lines.append(f"| first steps at new shapes: {key} | {first} | steady {ms(r['steady_step_s'])} "
                         f"| {r['ratio']:.2f} (goal <= 2) |")
        lines.append(f"| engine start-up (warm-up) | {n['startup_s']:.1f} s | - | - |")
    if "prefill_1m" in rows.get("long", {}):
        lp, ld = rows["long"]["prefill_1m"], rows["long"]["decode_1m"]
        lines.append(f"| 1M-token prompt TTFT, slice | {lp['ttft_s']:.1f} s (late step {ms(lp['late_step_median_s'])})"
                     f" | {lp['floor_s']:.1f} s | {lp['ratio']:.2f} |")
        lines.append(f"| decode at 1M, batch 1, slice | {ms(ld['median_step_s'])} | {ms(ld['floor_s'])} "
                     f"| {ld['ratio']:.2f} |")
    server = rows.get("server")
    if server:
        floor = server["echo_floor"]["summary"]["output_tok_s"]
        for c, run in server["runs"].items():
            s = run["summary"]
            lines.append(f"| server c={c}, built-in model | {s['output_tok_s']:.0f} tok/s, TPOT p50 "
                         f"{s['tpot_p50_ms']:.2f} / p99 {s['tpot_p99_ms']:.2f} ms | echo engine c=128: "
                         f"{floor:.0f} tok/s | {s['output_tok_s'] / floor:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serving.json")
    ap.add_argument("--long", action="store_true", help="also the 1M-token rows (minutes; memory checked)")
    ap.add_argument("--no-server", action="store_true", help="skip the server rows")
    ap.add_argument("--no-short", action="store_true", help="skip the 8k prompt, 4k decode and new-shape rows")
    ap.add_argument("--profile-slowest", action="store_true",
                    help="--long: run the last steps under cProfile and keep the slowest one's functions")
    ap.add_argument("--sync", action="store_true", help="--long: asynchronous scheduling off")
    args = ap.parse_args()
    out = Path(args.out)
    report = header()
    report["arguments"] = vars(args)
    report["rows"] = rows = {}

    def save():
        write_results(out.stem, report, directory=out.parent)

    report["ceilings"] = ceil = ceilings.measure("cuda")
    ceil.setdefault("matmul_flops_per_s_bfloat16", ceil["matmul_flops_per_s"])
    cfg = slice_config(False)
    if args.long:  # the slice's default position limit is below the 1M prompt (no position tables depend on it)
        cfg["max_position_embeddings"] = PROMPT_1M + 1024
    lm = random_model(cfg, torch.bfloat16, "cuda")
    free_memory()
    kernel_decode = decode(lm, 1, CONTEXT_4K, 10, ceil)
    kernel_prefill = prefill(lm, 8192, 3, ceil)
    report["kernel_only"] = dict(prefill_8192_s=kernel_prefill["median_s"], decode_4k_s=kernel_decode["graph_median_s"])
    free_memory()
    weight_only = kernel_decode["bytes"] - cache_bytes(lm.config.text, CONTEXT_4K, 1)
    if not args.no_short:
        short_rows(lm, rows, kernel_prefill, kernel_decode)
        save()
    if args.long:
        rows["long"] = long_rows(lm, ceil, weight_only, args.profile_slowest, args.sync)
        save()
    del lm
    free_memory()
    if not args.no_server:
        rows["server"] = server_rows(out.parent)
        save()
    report["table"] = table(report)
    save()
    print("\n".join(report["table"]))


if __name__ == "__main__":
    main()
