"""Where a step of the 4-layer slice spends its GPU time, per kernel name.

Builds the slice of ``bench/hotpath_slice.py`` (random release-format weights through the loader), then for each
decode batch (default 1, 32 and 128) at ``--context`` (default 4096): the step's time back to back (median of 3
timings of 10 replays enqueued, no host preparation between them), the synchronized wall time per step (host
preparation of the graph's inputs included), and the torch profiler's per-kernel GPU time over 5 replays, largest
first (launched without programmatic dependent launch, whose waits would count in each kernel's time; the
back-to-back time runs with it, as the engine does). With ``--prefill-chunk T`` it profiles instead one prefill step
of ``T`` new tokens after ``--context`` cached ones (a late step of a long prompt), eager as the engine runs it.
``--quantization w8a8`` (or ``fp8``) profiles the slice quantized at load, as ``flashinfra serve --quantization``
runs it; ``--set NAME=INT`` changes a config field
for an experiment (``hc_sinkhorn_iters=1``: what the mHC normalisation's 20 iterations cost a decode step).
``logits_digest`` (the first step's logits: sum and sum of squares, in float64) is the same in two runs whose
kernels compute the same thing (``FLASHINFRA_PDL=0`` against the default: only the launches differ). ``--against
FILE`` (an earlier run's JSON, e.g. another revision's in the same call) prints what changed per kernel; without a
GPU, ``--diff BEFORE.json AFTER.json`` prints the same for two saved runs.

usage: python bench/hotpath_profile.py --out bench/results/hotpath_decode_profile.json
       python bench/hotpath_profile.py --context 1048576 --batches 1 --out bench/results/hotpath_profile_1m.json
       python bench/hotpath_profile.py --quantization w8a8 --out bench/results/hotpath_decode_profile_w8a8.json
       python bench/hotpath_profile.py --context 1040384 --prefill-chunk 8192 \
           --out bench/results/hotpath_profile_1m_prefill.json
       python bench/hotpath_profile.py --diff bench/results/A.json bench/results/B.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import hotpath_slice as hs
import torch
from torch.profiler import ProfilerActivity, profile

from flashinfra import env
from flashinfra.feedback.timing import call_times_us, header, write_results
from flashinfra.kernels.launch import without_pdl
from flashinfra.model.api import random_model
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.engine.cuda_graphs import DecodeGraphs


def step_profile(lm, B: int, context: int, chunk: int = 0) -> dict:
    """Decode (``chunk`` 0, from a CUDA graph) of ``B`` sequences at ``context``, or one prefill step of ``chunk``
    tokens after ``context`` cached ones (eager)."""
    T = chunk or 1
    W = -(-(context + T) // hs.BS)
    torch.manual_seed(0)  # the same cache and tokens in every run: ``logits_digest`` compares runs
    cache = lm.allocate_cache(B * W + 1, hs.BS, B + 1)
    hs.fill_cache(cache)
    tables = [list(range(b * W, (b + 1) * W)) for b in range(B)]
    batch = ForwardBatch.build([T] * B, [context] * B, list(range(B)), tables, hs.BS, "cuda")
    ids = torch.randint(1, 1000, (B * T,), device="cuda")
    def stepper():
        if chunk:
            return lambda: lm.compute_logits(lm.forward(ids, batch, cache)[-1:])
        graphs = DecodeGraphs(lm, cache, B * W, B)
        return lambda: lm.compute_logits(graphs.run(ids, batch))

    step = stepper()

    first = step().double()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    # 15 timings of 10 steps, their spread kept with the median: runs of the same kernels have differed by up to
    # 40 us a step in the gaps between kernels (notes/quant.md)
    times = sorted(call_times_us(step, calls=10, iters=15, warmup=0))
    back_to_back_us = times[len(times) // 2]
    t0 = time.perf_counter()
    for _ in range(10):
        step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10
    # per kernel without programmatic dependent launch (a graph captured so): with it, a kernel's time holds its wait
    # for the one before, and the times of a chain overlap
    del step
    with without_pdl():
        lm.forward(ids, batch, cache)  # eager first: the kernels' variants without PDL compile outside a capture
        step = stepper()
        for _ in range(2):
            step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
    rows = []
    for a in prof.key_averages():
        t = getattr(a, "device_time_total", 0) or getattr(a, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 5, a.count / 5, a.key[:90]))
    rows.sort(reverse=True)
    digest = [float(first.sum()), float(first.square().sum())]  # equal across runs of the same kernels, bit for bit
    return dict(batch=B, context=context, chunk=chunk, logits_digest=digest, back_to_back_us=back_to_back_us,
                back_to_back_range_us=[times[0], times[-1]],
                wall_us=wall * 1e6,
                kernel_sum_us=sum(r[0] for r in rows), kernels_per_step=sum(r[1] for r in rows),
                kernels=[dict(us_per_step=t, calls_per_step=n, name=k) for t, n, k in rows[:60]])


def _range(step: dict) -> str:
    """`` (least-most)`` of a run's back-to-back timings; nothing for a run saved without them."""
    lo_hi = step.get("back_to_back_range_us")
    return f" ({lo_hi[0]:.0f}-{lo_hi[1]:.0f})" if lo_hi else ""


def diff(before: dict, after: dict, least_us: float = 1.5) -> str:
    """Per step of two runs (matched by batch, context and chunk): the totals, then every kernel whose time moved by
    ``least_us`` or more a step or whose calls a step changed, largest gain first."""
    lines = []
    old = {(s["batch"], s["context"], s["chunk"]): s for s in before["steps"]}
    for b in after["steps"]:
        a = old.get((b["batch"], b["context"], b["chunk"]))
        if a is None:
            continue
        same = "same" if a["logits_digest"] == b["logits_digest"] else "different"
        lines.append(f"B={b['batch']} context {b['context']} chunk {b['chunk']}: back-to-back "
                     f"{a['back_to_back_us']:.0f}{_range(a)} -> {b['back_to_back_us']:.0f}{_range(b)} us, kernel sum "
                     f"{a['kernel_sum_us']:.0f} -> {b['kernel_sum_us']:.0f} us, kernels {a['kernels_per_step']:.0f} -> "
                     f"{b['kernels_per_step']:.0f}, logits {same}")
        ka, kb = ({k["name"]: k for k in s["kernels"]} for s in (a, b))
        rows = []
        for name in ka.keys() | kb.keys():
            x, y = ka.get(name, {}), kb.get(name, {})
            us = (x.get("us_per_step", 0.0), y.get("us_per_step", 0.0))
            calls = (x.get("calls_per_step", 0.0), y.get("calls_per_step", 0.0))
            if abs(us[1] - us[0]) >= least_us or calls[0] != calls[1]:
                rows.append((us[1] - us[0], us, calls, name))
        for d, us, calls, name in sorted(rows):
            lines.append(f"  {d:+8.1f} us  {us[0]:8.1f} -> {us[1]:8.1f}  calls {calls[0]:.0f} -> {calls[1]:.0f}  "
                         f"{name[:80]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/hotpath_decode_profile.json")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,32,128", help="decode batch sizes (one with --prefill-chunk)")
    ap.add_argument("--prefill-chunk", type=int, default=0, help="profile a prefill step of this many tokens")
    ap.add_argument("--quantization", default="none", choices=("none", "w8a8", "fp8"))
    ap.add_argument("--set", action="append", default=[], metavar="NAME=INT",
                    help="a text-config field changed for the experiment (e.g. hc_sinkhorn_iters=1: what the mHC "
                         "normalisation's iterations cost); repeatable")
    ap.add_argument("--against", type=Path, help="an earlier run's JSON: print what changed per kernel")
    ap.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="only print what changed between two saved runs (no GPU)")
    args = ap.parse_args()
    if args.diff:
        print(diff(*(json.loads(p.read_text()) for p in args.diff)))
        return
    hs.DEV = "cuda"
    cfg = hs.slice_config(False)
    cfg["max_position_embeddings"] = max(args.context + args.prefill_chunk + 1024, 4096)  # the slice's limit is 4096
    for item in args.set:
        name, value = item.split("=", 1)
        cfg[name] = int(value)
    # its own lm_head, as the model has (untied), which W8A8 quantizes
    cfg = dict(architectures=["Glm5NextForConditionalGeneration"], tie_word_embeddings=False, text_config=cfg)
    lm = random_model(cfg, torch.bfloat16, "cuda", quantization=args.quantization)
    hs.free_memory()
    report = header() | {"programmatic_launch": env.programmatic_launch(), "context": args.context,
                         "prefill_chunk": args.prefill_chunk,
                         "quantization": args.quantization, "set": args.set, "steps": []}
    for B in [int(b) for b in args.batches.split(",")]:
        r = step_profile(lm, B, args.context, args.prefill_chunk)
        hs.free_memory()  # the step's cache and graphs
        report["steps"].append(r)
        print(f"B={B}: back-to-back {r['back_to_back_us']:.0f} us/step, synced wall {r['wall_us']:.0f} us/step, "
              f"kernel sum {r['kernel_sum_us']:.0f} us/step in {r['kernels_per_step']:.0f} kernels")
        for k in r["kernels"][:20]:
            print(f"  {k['us_per_step']:8.1f} us  x{k['calls_per_step']:4.1f}  {k['name']}")
        out = Path(args.out)
        write_results(out.stem, report, directory=out.parent)  # after each batch size
    if args.against:
        print(diff(json.loads(args.against.read_text()), report))


if __name__ == "__main__":
    main()
