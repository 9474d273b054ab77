"""Context parallelism on one host: a ~1M-token prefill on 1, 2, 4 or 8 GPUs (TTFT, tokens/s, engine steps, peak
device memory per rank) and the cache capacity per rank with and without Layer Split.

Model: the 4-layer full-width slice of ``bench/hotpath_slice.py`` (``slice_config``) with random bf16 weights
(``--load-format random``, seed 0: every rank draws the same whole model on its GPU; ``--model-dir`` holds no
weights: ``plan.write_model_dir``). For each N in ``--gpus`` the engine runs under ``torchrun --nproc-per-node N`` with
``context_parallel_size=N`` (zig-zag split; ``--layer-split`` runs it with Layer Split): rank 0 holds the
``EngineCore`` (``parallel.engine.make_engine``), the other ranks serve its steps. Rank 0 times one
``--prompt-len``-token request with one output token through ``serving_rows.prefill_row`` (``--warmup`` untimed
prompts first, each a fresh random prompt; device-synchronized), with a token budget of ``--tokens-per-rank`` x N
per step, so every split step gives each rank the same share as the one-GPU run's step. Every rank reports its
peak allocated and reserved device memory over its whole life (weights, cache, prefill) and its peak host memory.

Capacity: the engine's own sizing (``runner.size_cache``) of one rank's cache at a per-rank budget
(``--cache-gib``, else what the engine gives its cache on that device: 85% of the memory free after the model
loads), with every MLA layer's bytes per block (replicated) and with the busiest rank's under Layer Split
(``layer_split.cache_tokens``). Every rank of the group caches every position (whole, or its own MLA layers), so
the tokens per rank are the tokens the group holds. The slice has one MLA layer, for which Layer Split cannot
gain, so the released model's 11 MLA layers are sized in the same budget too (``glm_5_3_flash``).

Writes ``bench/results/context_parallel_<N>gpu.json`` per N (header: device, command, date) with the one-GPU run
of the same command beside it (speed-up, memory per GPU) when 1 is in ``--gpus``, and prints a table.

usage: python bench/context_parallel.py --gpus 1 8 --out $OUT     # nvidia-h200-x8 (x4: --gpus 1 4, x2: --gpus 1 2)
       python bench/context_parallel.py --smoke                   # the same path on the CPU: tiny model, gloo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hotpath_slice import prefill_flops, slice_config  # noqa: E402
from serve_runs import log_tail, repo_env  # noqa: E402
from serving_rows import prefill_row  # noqa: E402

from flashinfra.config import resolve_config  # noqa: E402
from flashinfra.engine.config import EngineConfig  # noqa: E402
from flashinfra.feedback.timing import header, write_results  # noqa: E402
from flashinfra.model.factory import TINY_TEXT_CONFIG  # noqa: E402
from flashinfra.parallel.plan import write_model_dir  # noqa: E402

GIB = 2**30
PROMPT_1M = 1_048_544  # serving.py's long row
LONGEST = 2**62  # capacity: no cap from the sequence length
# a tiny model with 4 MLA layers of 6, each with its own indexer: Layer Split over 2 ranks keeps 3 layers' bytes
SMOKE_TEXT = {**TINY_TEXT_CONFIG, "layer_types": ["linear_attention", "indexed_attention", "indexed_attention"] * 2,
              "indexer_types": ["full"] * 6}


def model_config(args) -> dict:
    """The model's ``config.json``: a bare text model (logits from the embedding), positions past the prompt."""
    raw = dict(SMOKE_TEXT) if args.smoke else slice_config(False)
    return dict(raw, architectures=["Glm5NextTextModel"], max_position_embeddings=args.prompt_len + 1024)


def memory(device: str) -> dict:
    """This process's peak device memory (allocated and reserved, None on the CPU) and peak host memory."""
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if not device.startswith("cuda"):
        return dict(device_peak_bytes=None, device_peak_reserved_bytes=None, device_total_bytes=None,
                    host_peak_bytes=host)
    return dict(device_peak_bytes=torch.cuda.max_memory_allocated(device),
                device_peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                device_total_bytes=torch.cuda.get_device_properties(device).total_memory, host_peak_bytes=host)


def capacity(engine, cache_gib: float | None) -> dict:
    """Cache tokens per rank in one rank's budget, by the engine's sizing, replicated and under Layer Split."""
    from flashinfra.engine.runner import CPU_DEFAULT_CACHE_BYTES, GPU_CACHE_FRACTION, size_cache
    from flashinfra.model.cache import ModelCache
    from flashinfra.parallel.layer_split import cache_tokens
    from flashinfra.parallel.plan import GLM_5_3_FLASH

    model, config, world = engine.model, engine.config, engine.config.context_parallel_size
    if cache_gib is not None:
        budget, source = int(cache_gib * GIB), "--cache-gib"
    elif model.device.type == "cuda":  # the engine's default: a fraction of the memory free after loading
        torch.cuda.empty_cache()
        cache = engine.runner.cache
        held = {t.data_ptr(): t.nbytes for d in (cache.mla_latent, cache.indexer_keys, cache.indexer_pool_keys,
                                                 cache.conv_state, cache.recurrent_state) for t in d.values()}
        budget = int((torch.cuda.mem_get_info(model.device)[0] + sum(held.values())) * GPU_CACHE_FRACTION)
        source = f"engine default: {GPU_CACHE_FRACTION} x (device memory free after the run + the run's own cache)"
    else:
        budget, source = CPU_DEFAULT_CACHE_BYTES, "engine default on the CPU"
    text, bs = model.config.text, config.block_size
    per_block = dict(replicated=ModelCache.bytes_per_block(text, bs, model.dtype, model.latent_dtypes()))
    if world > 1:
        per_block["layer_split"] = cache_tokens(text, world, 0, model.dtype).bytes_per_token_split * bs
    sizing = dataclasses.replace(config, num_blocks=None, kv_cache_memory=budget, max_num_seqs=1, prefix_cache_slots=0)
    out = dict(budget_bytes_per_rank=budget, budget_from=source, block_size=bs, bytes_per_block=per_block,
               tokens_per_rank={k: size_cache(model, sizing, LONGEST, b) * bs for k, b in per_block.items()})
    released = cache_tokens(resolve_config(GLM_5_3_FLASH).text, max(world, 1), budget, torch.bfloat16)
    out["glm_5_3_flash"] = dict(what="MLA cache tokens per rank of the released model's 11 MLA layers, bf16",
                                replicated=released.tokens_replicated,
                                layer_split=released.tokens_split if world > 1 else None)
    return out


def rank_main(spec_path: Path) -> None:
    """One rank under torchrun: rank 0 times the prefill on its engine, every rank reports its memory."""
    from flashinfra.parallel.engine import make_engine

    spec = json.loads(spec_path.read_text())
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    config = EngineConfig(**spec["engine"])
    device = f"cuda:{local}" if config.device.startswith("cuda") else "cpu"
    report, start = dict(rank=rank), time.perf_counter()
    try:
        engine = make_engine(config)
    except SystemExit:  # a rank other than 0: it served rank 0's steps in make_engine until the engine closed
        engine = None
    if engine is not None:
        report["startup_s"] = time.perf_counter() - start
        try:
            report["prefill"] = prefill_row(lambda: engine, spec["prompt_len"], reps=spec["reps"],
                                            warmup=spec["warmup"])
            report["flops"] = prefill_flops(engine.model, spec["prompt_len"])
            comm = getattr(engine.model, "comm", None)  # counts the split steps' collectives (plans go uncounted)
            report["collectives"] = comm.calls if comm is not None else 0
            report["capacity"] = capacity(engine, spec["cache_gib"])
        finally:
            engine.close()
    report["memory"] = memory(device)
    (spec_path.parent / f"rank{rank}.json").write_text(json.dumps(report))


def run_world(args, world: int, model_dir: Path) -> dict:
    """The ranks of one world size under torchrun; rank 0's figures with every rank's memory."""
    runs = model_dir / "runs" / f"{world}gpu"
    runs.mkdir(parents=True, exist_ok=True)
    for old in runs.glob("rank*.json"):
        old.unlink()
    engine = dict(model=str(model_dir), load_format="random", seed=0, device=args.device, dtype=args.dtype,
                  context_parallel_size=world,
                  context_parallel_zigzag=not args.contiguous, layer_split=args.layer_split and world > 1,
                  max_num_seqs=1, max_model_len=args.prompt_len + 16,
                  max_num_batched_tokens=args.tokens_per_rank * world, dist_timeout_s=1800.0)
    spec = runs / "spec.json"
    spec.write_text(json.dumps(dict(engine=engine, prompt_len=args.prompt_len, reps=args.reps, warmup=args.warmup,
                                    cache_gib=args.cache_gib)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--rank-run", str(spec)]
    log = runs / "ranks.log"
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(cmd, env=repo_env(), stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{world} ranks exited with code {code}; {log} ends:\n" + "\n".join(log_tail(log)))
    ranks = [json.loads((runs / f"rank{r}.json").read_text()) for r in range(world)]
    r0, peaks = ranks[0], [r["memory"]["device_peak_bytes"] for r in ranks]
    ttft = r0["prefill"]["ms"] / 1e3
    return dict(gpus=world, engine=engine, ttft_s=ttft, tokens_per_s=r0["prefill"]["tokens_per_s"],
                steps=r0["prefill"]["steps"], startup_s=r0["startup_s"], flops=r0["flops"],
                collectives=r0["collectives"],
                tflops_per_s_per_gpu=r0["flops"] / ttft / world / 1e12, prefill=r0["prefill"],
                peak_bytes_per_gpu=None if None in peaks else max(peaks),
                host_peak_bytes=max(r["memory"]["host_peak_bytes"] for r in ranks),
                ranks=[r["memory"] for r in ranks], capacity=r0["capacity"], wall_s=time.perf_counter() - start,
                log_tail=log_tail(log))


def against(run: dict, one: dict | None) -> dict | None:
    """The one-GPU run of the same command beside ``run``: speed-up and memory per GPU."""
    if one is None or one is run:
        return None
    peak, one_peak = run["peak_bytes_per_gpu"], one["peak_bytes_per_gpu"]
    return dict(ttft_s=one["ttft_s"], peak_bytes_per_gpu=one_peak, speedup=one["ttft_s"] / run["ttft_s"],
                efficiency=one["ttft_s"] / run["ttft_s"] / run["gpus"],
                peak_per_gpu_ratio=None if None in (peak, one_peak) else peak / one_peak)


def table(runs: list[dict]) -> list[str]:
    lines = ["| GPUs | TTFT | tok/s | steps | speed-up | peak GiB / GPU | cache tokens / rank: replicated, Layer Split "
             "| GLM-5.3-Flash MLA tokens / rank: replicated, Layer Split |", "| --- " * 8 + "|"]
    for r in runs:
        cap, vs = r["capacity"], r.get("one_gpu")
        peak = r["peak_bytes_per_gpu"]
        mem = f"{peak / GIB:.2f}" if peak is not None else f"{r['host_peak_bytes'] / GIB:.2f} (host)"
        tok, glm = cap["tokens_per_rank"], cap["glm_5_3_flash"]
        speedup = f"{vs['speedup']:.2f}x" if vs else "-"
        lines.append(f"| {r['gpus']} | {r['ttft_s']:.3f} s | {r['tokens_per_s']:.0f} | {r['steps']} "
                     f"| {speedup} | {mem} | {tok['replicated']}, "
                     f"{tok.get('layer_split', '-')} | {glm['replicated']}, {glm['layer_split'] or '-'} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", help="context-parallel sizes, one after another (default 1 2)")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {PROMPT_1M}; smoke 4196)")
    p.add_argument("--tokens-per-rank", type=int, help="token budget of a step per rank (default 8192; smoke 1024)")
    p.add_argument("--reps", type=int, default=1, help="timed prompts (the median is kept)")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts of the same length first")
    p.add_argument("--layer-split", action="store_true", help="run the N > 1 engines with Layer Split")
    p.add_argument("--contiguous", action="store_true", help="contiguous parts instead of the zig-zag split")
    p.add_argument("--cache-gib", type=float, help="capacity budget per rank (default: the engine's own)")
    p.add_argument("--model-dir", type=Path, help="where the model's config.json is written (default under /tmp)")
    p.add_argument("--smoke", action="store_true", help="tiny model, float32 CPU ranks over gloo, a short prompt")
    p.add_argument("--out", default=None, help="also copy the JSON into this folder (smoke: only there)")
    p.add_argument("--rank-run", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_run:
        return rank_main(args.rank_run)
    smoke = args.smoke
    args.gpus = args.gpus or [1, 2]
    args.prompt_len = args.prompt_len or (4196 if smoke else PROMPT_1M)
    args.tokens_per_rank = args.tokens_per_rank or (1024 if smoke else 8192)
    args.device, args.dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    model_dir = args.model_dir or Path("/tmp/flashinfra-context-parallel-" + ("smoke" if smoke else "slice"))
    write_model_dir(model_config(args), model_dir)
    runs = []
    for world in args.gpus:
        runs.append(run_world(args, world, model_dir))
        print(f"{world} GPU(s): TTFT {runs[-1]['ttft_s']:.3f} s in {runs[-1]['steps']} steps", flush=True)
    one = next((r for r in runs if r["gpus"] == 1), None)
    for run in runs:
        run["one_gpu"] = against(run, one)
    lines = table(runs)
    for run in runs:  # after the runs: this process touches no GPU while they run
        results = header()
        if smoke:
            results["device"] += " (smoke)"
        results.update(arguments={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                       model=model_config(args), run=run, table=lines)
        name = f"context_parallel_{run['gpus']}gpu" + ("_layer_split" if args.layer_split else "")
        if smoke:
            print(write_results(name + "_smoke", results, directory=args.out or model_dir / "runs"))
        else:
            print(write_results(name, results, args.out))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
