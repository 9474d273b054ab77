"""The cost of deterministic mode on the 4-layer full-width GLM-5.3-Flash slice (``hotpath_slice.py``'s model, random
release-format weights in bf16): decode steps at batch 1, 32 and 128 (eager and CUDA-graph replay, ``--context``
tokens cached) and prefills (one ``--prefill``-token sequence, and 32 sequences of ``--prefill // 32`` tokens packed),
each with and without ``dispatch.deterministic``, the two in alternation per case so that drift in clocks hits
both alike. Ratio = deterministic time / default time; goal: at most 1.25.

Each case also records whether deterministic mode kept the first sequence's logits the same bits alone as inside the
batch (decode: the same cache contents; prefill: the same prompt), next to whether the default path did.

``--generate``: the 48-prompt experiment of ``tests/test_deterministic_gpu.py`` on the slice, through an engine
(``EngineCore`` on the loaded slice): 48 prompts of 5 to 400 random tokens, 64 greedy tokens each, as one batch, one
at a time, rerun on the prefix cache, with prefix caching off and in a cache small enough to preempt; per mode, how
many of the 48 outputs differ from the batch's.

usage: python bench/deterministic.py --out bench/results/deterministic.json [--smoke] [--kernels] [--generate]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hotpath_slice import BS, fill_cache, slice_config, timed

import hotpath_slice
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.cuda_graphs import DecodeGraphs
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams
from flashinfra.feedback.timing import header, write_results
from flashinfra.kernels.dispatch import deterministic
from flashinfra.model.api import LoadedModel, random_model
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.invariance import clone_cache

GOAL = 1.25


def decode_case(lm: LoadedModel, B: int, context: int, steps: int, graphs: bool) -> dict:
    dev = lm.device
    W = -(-(context + 1) // BS)
    cache = lm.allocate_cache(B * W + 1, BS, B + 1)
    fill_cache(cache)
    tables = [list(range(b * W, (b + 1) * W)) for b in range(B)]
    batch = ForwardBatch.build([1] * B, [context] * B, list(range(B)), tables, BS, dev)
    alone = ForwardBatch.build([1], [context], [0], tables[:1], BS, dev)
    ids = torch.randint(1, 1000, (B,), device=dev)
    out = dict(batch=B, context=context)
    for det in (False, True):
        with deterministic(det):
            a = lm.compute_logits(lm.forward(ids, batch, clone_cache(cache)))[0]
            b = lm.compute_logits(lm.forward(ids[:1], alone, clone_cache(cache)))[0]
            out[f"{'deterministic' if det else 'default'}_alone_equals_batched"] = bool(torch.equal(a, b))
    times: dict[str, list[float]] = {}
    runners = {}
    for det in (False, True):
        with deterministic(det):
            runners[det] = DecodeGraphs(lm, cache, B * W, B) if graphs else None
            if graphs:
                runners[det].run(ids, batch)  # captured in its mode
    for _ in range(3):  # alternate the modes
        for det in (False, True):
            with deterministic(det):
                step = ((lambda g=runners[det]: lm.compute_logits(g.run(ids, batch))) if graphs
                        else (lambda: lm.compute_logits(lm.forward(ids, batch, cache))))
                times.setdefault(det, []).extend(timed(step, max(1, steps // 3)))
    return _ratio(out, times, "graph" if graphs else "eager")


def prefill_case(lm: LoadedModel, lengths: list[int], reps: int) -> dict:
    dev = lm.device
    need = [-(-n // BS) for n in lengths]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(lengths))]
    batch = ForwardBatch.build(lengths, [0] * len(lengths), list(range(len(lengths))), tables, BS, dev)
    alone = ForwardBatch.build(lengths[:1], [0], [0], tables[:1], BS, dev)
    cache = lm.allocate_cache(sum(need), BS, len(lengths))
    ids = torch.randint(1, 1000, (sum(lengths),), device=dev)
    last = torch.tensor(batch.last_token_indices, device=dev)
    out = dict(sequences=len(lengths), tokens=sum(lengths))
    for det in (False, True):
        with deterministic(det):
            a = lm.compute_logits(lm.forward(ids, batch, cache)[last])[0]
            b = lm.compute_logits(lm.forward(ids[: lengths[0]], alone, cache)[-1:])[0]
            out[f"{'deterministic' if det else 'default'}_alone_equals_batched"] = bool(torch.equal(a, b))
    times: dict[bool, list[float]] = {}
    for _ in range(3):
        for det in (False, True):
            with deterministic(det):
                times.setdefault(det, []).extend(
                    timed(lambda: lm.compute_logits(lm.forward(ids, batch, cache)[last]), max(1, reps // 3)))
    return _ratio(out, times, "prefill")


def prefill_kernels(lm: LoadedModel, n: int, top: int = 12) -> dict:
    """Where the prefill's time goes in each mode: one ``n``-token prefill under the profiler, its top kernels (the
    GPU time per kernel name, ``feedback.trace``)."""
    from flashinfra.feedback.trace import profile_steps, summarize_trace

    dev = lm.device
    batch = ForwardBatch.build([n], [0], [0], [list(range(-(-n // BS)))], BS, dev)
    cache = lm.allocate_cache(-(-n // BS), BS, 1)
    ids = torch.randint(1, 1000, (n,), device=dev)
    out = {}
    for det in (False, True):
        with deterministic(det), tempfile.TemporaryDirectory() as tmp:
            path = profile_steps(lambda i: lm.forward(ids, batch, cache), 2, str(dev), Path(tmp) / "prefill")
            s = summarize_trace(path, top=top)
        out["deterministic" if det else "default"] = {
            "gpu_busy_s_per_prefill": s["gpu_busy_s"] / 2,
            "top_kernels": [{"name": k["name"][:90], "s_per_prefill": k["total_s"] / 2, "count": k["count"] // 2}
                            for k in s["top_kernels"]]}
    return out


_request_ids = itertools.count()


def _generate(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt's greedy tokens, the prompts queued together."""
    ids = [f"g{next(_request_ids)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        core.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                       time.time()))
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    while core.has_work():
        for o in core.step():
            if o.error:
                raise RuntimeError(o.error)
            out[o.request_id].extend(o.new_token_ids)
    return [out[rid] for rid in ids]


def generate_case(lm: LoadedModel, max_tokens: int = 64) -> dict:
    """The 48-prompt experiment on the slice in each mode: outputs differing from the batch of 48's."""
    rng = random.Random(48)
    vocab = lm.config.text.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(5 + 395 * i // 47)] for i in range(48)]
    counts = {}
    for det in (False, True):
        def core(**kw):
            return EngineCore(EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=48, max_model_len=1024,
                                           kv_cache_memory=4 << 30, deterministic=det, startup_warmup=False,
                                           **kw), model=lm)

        hits = core(prefix_cache_slots=2 * len(prompts))
        batched = _generate(hits, prompts, max_tokens)
        rerun = _generate(hits, prompts, max_tokens)
        hit_tokens = hits.stats().num_prefix_hit_tokens_total
        del hits
        cold = core(prefix_cache_slots=0)
        alone = [_generate(cold, [p], max_tokens)[0] for p in prompts]
        no_prefix = _generate(cold, prompts, max_tokens)
        del cold
        small = core(prefix_cache_slots=0, num_blocks=300)
        preempted = _generate(small, prompts, max_tokens)
        preemptions = small.stats().num_preemptions_total
        del small
        torch.cuda.empty_cache()
        counts["deterministic" if det else "default"] = dict(
            {name: sum(a != b for a, b in zip(batched, other))
             for name, other in (("alone", alone), ("prefix hit", rerun), ("no prefix cache", no_prefix),
                                 ("preempted", preempted))}, prefix_hit_tokens=hit_tokens, preemptions=preemptions)
    return dict(kind="generate", prompts=len(prompts), max_tokens=max_tokens, differing_outputs=counts,
                deterministic_all_equal=all(v == 0 for k, v in counts["deterministic"].items()
                                            if k not in ("prefix_hit_tokens", "preemptions")))


def _ratio(out: dict, times: dict, kind: str) -> dict:
    base, det = statistics.median(times[False]), statistics.median(times[True])
    out.update(kind=kind, default_median_s=base, deterministic_median_s=det, ratio=det / base,
               within_goal=det / base <= GOAL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/deterministic.json")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--kernels", action="store_true", help="also profile one prefill in each mode: its top kernels")
    ap.add_argument("--generate", action="store_true", help="only the 48-prompt experiment on the slice (GPU)")
    args = ap.parse_args()
    if args.smoke:
        hotpath_slice.DEV = "cpu"
        args.context, args.prefill, args.steps, args.reps = 40, 64, 3, 3
    dev = hotpath_slice.DEV
    out = Path(args.out)
    report = header()
    report.update(goal_ratio=GOAL, context=args.context, prefill=args.prefill, cases=[])
    cfg = slice_config(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    lm = random_model(cfg, dtype, dev)
    torch.manual_seed(0)
    if args.generate:
        report["generate"] = generate_case(lm)
        print(report["generate"], flush=True)
        write_results(out.stem, report, directory=out.parent)
        return
    cases = [lambda B=B: decode_case(lm, B, args.context, args.steps, graphs=False) for B in (1, 32, 128)]
    if dev == "cuda":
        cases += [lambda B=B: decode_case(lm, B, args.context, args.steps, graphs=True) for B in (1, 32, 128)]
    cases += [lambda: prefill_case(lm, [args.prefill], args.reps),
              lambda: prefill_case(lm, [args.prefill // 32] * 32, args.reps)]
    for case in cases:
        report["cases"].append(case())
        print(report["cases"][-1], flush=True)
        report["worst_ratio"] = max(c["ratio"] for c in report["cases"])
        report["all_within_goal"] = all(c["within_goal"] for c in report["cases"])
        write_results(out.stem, report, directory=out.parent)
    if args.kernels:
        report["prefill_kernels"] = prefill_kernels(lm, args.prefill)
        for mode, k in report["prefill_kernels"].items():
            print(f"{mode}: {k['gpu_busy_s_per_prefill'] * 1e3:.2f} ms of kernels per prefill")
            for row in k["top_kernels"]:
                print(f"  {row['s_per_prefill'] * 1e3:8.3f} ms  x{row['count']:<4} {row['name']}")
        write_results(out.stem, report, directory=out.parent)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
