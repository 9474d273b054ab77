"""The speculative verify step on the 4-layer full-width GLM-5.3-Flash slice: a step of ``k + 1`` tokens per row
through the verify graph (every KDA layer on the ReplaySSM verify path: the checkpoint read, the ring written) against
a decode step of one token per row, both CUDA-graph replays with their logits, at ``--context`` tokens cached.

Per (batch, k): the median step time, its ratio to the decode step of the same batch (what a verify step costs in
decode steps: the accepted tokens per step must exceed it for speculation to pay), and its floor, the bytes the step
must move (the weights its tokens' routing touches, counted from the router, the embedding the logits read, the
cache as ``hotpath_slice.cache_bytes`` counts it, and for a verify step the ring entries it writes) over the copy
bandwidth measured in the same run. The slice is ``hotpath_slice.py``'s (random release-format tensors, bf16).

usage: python bench/verify_slice.py --out bench/results/verify_slice.json [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import hotpath_slice as hs
import torch

from flashinfra.engine.cuda_graphs import DecodeGraphs
from flashinfra.feedback import ceilings
from flashinfra.feedback.timing import header, write_results
from flashinfra.model import moe as moe_module
from flashinfra.model.api import random_model
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.replay import ReplayRing


def step(lm, batch_size: int, k: int, context: int, steps: int, ceil: dict, dev: str) -> dict:
    """A decode (``k = 0``) or verify step's median time and floor."""
    cfg, q = lm.config.text, k + 1
    W = -(-(context + q) // hs.BS)
    cache = lm.allocate_cache(batch_size * W + 1, hs.BS, batch_size + 1)
    hs.fill_cache(cache)
    if k:
        H, K = cfg.linear_num_heads, cfg.linear_head_dim
        cache.replay.update({i: ReplayRing.allocate(cache.num_slots, q, H, K, K, lm.dtype, dev)
                             for i in cfg.kda_layers})
    tables = [list(range(b * W, (b + 1) * W)) for b in range(batch_size)]
    batch = ForwardBatch.build([q] * batch_size, [context] * batch_size, list(range(batch_size)), tables, hs.BS, dev)
    if k:
        batch = dataclasses.replace(batch, replay=(True,) * batch_size)
    ids = torch.randint(1, 1000, (batch_size * q,), device=dev)
    recorder = hs.RoutingRecorder()
    moe_module.route = recorder
    try:
        lm.compute_logits(lm.forward(ids, batch, cache))
    finally:
        moe_module.route = recorder.inner
    if dev == "cuda":
        graphs = DecodeGraphs(lm, cache, batch_size * W, batch_size, verify_q=max(q, 2))
        graphs.run(ids, batch)
        times = hs.timed(lambda: lm.compute_logits(graphs.run(ids, batch)), steps)
    else:
        times = hs.timed(lambda: lm.compute_logits(lm.forward(ids, batch, cache)), steps)
    # a verify step also writes each token's ring entry in every KDA layer
    entry = sum(t[0, 0].numel() * t.element_size() for r in cache.replay.values() for t in (r.x, r.k, r.v, r.g, r.beta))
    nbytes = (hs.weight_bytes(lm, recorder.calls, batch_size * q) + hs.cache_bytes(cfg, context, batch_size)
              + batch_size * q * entry)
    floor = nbytes / ceil["copy_bytes_per_s"]
    median = statistics.median(times)
    return dict(batch=batch_size, k=k, context=context, experts_touched=recorder.calls, bytes=nbytes, floor_s=floor,
                median_s=median, frac_of_floor=floor / median)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/verify_slice.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--ks", default="1,3,5", help="drafts per row; each beside k = 0 (decode)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU (TRITON_INTERPRET=1), eager")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    hs.DEV = dev
    report = header()
    report["arguments"] = vars(args)
    out = Path(args.out)
    report["ceilings"] = ceil = ceilings.measure(dev, quick=args.smoke)
    cfg = hs.slice_config(args.smoke)
    lm = random_model(cfg, torch.float32 if args.smoke else torch.bfloat16, dev)
    context = 96 if args.smoke else args.context
    report["rows"] = rows = []
    for b in (int(x) for x in args.batches.split(",")):
        decode = step(lm, b, 0, context, args.steps, ceil, dev)
        rows.append(decode)
        hs.free_memory()
        for k in (int(x) for x in args.ks.split(",")):
            row = step(lm, b, k, context, args.steps, ceil, dev)
            row["decode_steps"] = row["median_s"] / decode["median_s"]
            rows.append(row)
            hs.free_memory()
            print(f"batch {b:4d} k {k}: verify {1e3 * row['median_s']:.3f} ms = {row['decode_steps']:.2f} decode "
                  f"steps ({1e3 * decode['median_s']:.3f} ms); floor {1e3 * row['floor_s']:.3f} ms", flush=True)
        write_results(out.stem, report, directory=out.parent)


if __name__ == "__main__":
    main()
