"""The KDA layer decode in micro-batches on two streams (``micro_batches``, flashinfra/kernels/microbatch.py): the
batch cut into row ranges, each range's launches (prep, state, norm) in order on one stream, the ranges alternating
between the caller's stream and a side stream, so that one range's prep and norm launches run beside another
range's state launch. Beside the launcher's even splits: the same two ranges on one stream (what the split alone
costs) and uneven ranges (a short first or last range). Timed in a CUDA graph of one call and of ten back-to-back
calls (as a decode step's graph holds every layer), against the single launch (``micro_batches=1``) in the same
process; each variant's output and states checked equal to the single launch's. H=64, K=V=128, fp32 and bf16
state, each at ``decode_config``'s layout for the whole batch.

    python bench/kda_decode_microbatch.py [--batches 16,32,48,64,128,256] [--out DIR]
        -> bench/results/kda_decode_microbatch.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import capture_graph, copy_bandwidth_GBps, header, time_eager, write_results  # noqa: E402
from kda_decode import H, V, layer_bytes, layer_inputs  # noqa: E402

from flashinfra.kernels.kda.decode import decode_config, kda_layer_decode_launch  # noqa: E402
from flashinfra.kernels.microbatch import on_two_streams  # noqa: E402

ROW_ARGS = ("qkv", "g_raw", "beta_logits", "gate", "state_slots")  # the per-sequence inputs; the rest are shared
BLOCK64 = dict(grid="block", BV=64, num_warps=4, maxnreg=128)  # no prep launch: the state kernel does the head work
# name -> micro-batches of the launcher (``micro_batches``), or its options (a dict), or fractions of the batch per
# range with the streams:
# "two" alternating the caller's and the side stream (microbatch.on_two_streams), "one" all on the caller's stream,
# "hiA" / "hiB" the first / second of two ranges on a high-priority stream;
# and optionally the first range's own launch options (the block layout: nothing launched before its state kernel)
VARIANTS = {"single": 1, "mb2": 2, "mb3": 3, "mb4": 4, "mb2_one_stream": ((1, 1), "one"), "mb_1_3": ((1, 3), "two"),
            "mb_1_2_1": ((1, 2, 1), "two"), "blockA_1_1": ((1, 1), "two", BLOCK64),
            "blockA_1_3": ((1, 3), "two", BLOCK64), "blockA_1_7": ((1, 7), "two", BLOCK64),
            "blockA32_1_3": ((1, 3), "two", dict(grid="block", BV=32, num_warps=2)),
            "hiA_1_1": ((1, 1), "hiA"), "hiA_1_3": ((1, 3), "hiA"), "hiA_3_1": ((3, 1), "hiA"),
            # a short first range in the block layout (its state launch needs no prep launch before it) beside the
            # rest on a high-priority stream: the short range's state programs take only the slots the rest's prep
            # and state launches leave free, so they fill the rest's prep time and its state launch's last wave
            "hiB_1_15": ((1, 15), "hiB"), "blockA_1_15": ((1, 15), "two", BLOCK64),
            "blockLo_1_15": ((1, 15), "hiB", BLOCK64), "blockLo_1_7": ((1, 7), "hiB", BLOCK64),
            "blockLo32_1_15": ((1, 15), "hiB", dict(grid="block", BV=32, num_warps=2)),
            # a bf16 state's layouts at small batches: the tiles layout with the tensor-core step, whole and in two,
            # and the streaming layout (persistent programs)
            "tiles": dict(grid="tiles", BV=64, num_warps=4, maxnreg=96, dot_sums=True, prep_heads=1, norm_heads=4),
            "tiles_mb2": dict(grid="tiles", BV=64, num_warps=4, maxnreg=96, dot_sums=True, prep_heads=1,
                              norm_heads=4, micro_batches=2),
            "stream": dict(grid="stream", BV=32, num_warps=2, prep_heads=2, norm_heads=4)}
_HIGH: list = []  # a high-priority stream for the "hiA" and "hiB" variants


def one_range_high(ranges: list[tuple[int, int]], launch, high_index: int) -> None:
    """Two ranges: ``ranges[high_index]`` on a high-priority side stream, the other on the caller's stream, so that
    the block scheduler dispatches the high one's programs first wherever both launches have programs waiting."""
    main = torch.cuda.current_stream()
    if not _HIGH:
        _HIGH.append(torch.cuda.Stream(priority=-1))
    high = _HIGH[0]
    high.wait_stream(main)
    for i, (lo, hi) in enumerate(ranges):
        with torch.cuda.stream(high if i == high_index else main):
            launch(lo, hi)
    main.wait_stream(high)


def ranges_of(B: int, parts: tuple) -> list[tuple[int, int]]:
    cuts = [round(B * sum(parts[:i]) / sum(parts)) for i in range(len(parts) + 1)]
    return list(zip(cuts, cuts[1:]))


def one_call(variant, a: dict, cfg: dict) -> torch.Tensor:
    """One layer call: the launcher with ``micro_batches`` (an int), or its ranges launched here at the whole
    batch's configuration (``cfg``; the first range at its own options where the variant gives them) on two
    streams or one."""
    if isinstance(variant, int):
        return kda_layer_decode_launch(**a, micro_batches=variant)
    if isinstance(variant, dict):
        return kda_layer_decode_launch(**a, **variant)
    parts, streams, *first = variant
    out = torch.empty(a["qkv"].shape[0], H, V, dtype=a["qkv"].dtype, device="cuda")

    def rows(lo: int, hi: int) -> None:
        kda_layer_decode_launch(**{k: (x[lo:hi] if k in ROW_ARGS else x) for k, x in a.items()}, out=out[lo:hi],
                                **(first[0] if first and lo == 0 else {**cfg, "micro_batches": 1}))

    ranges = ranges_of(out.shape[0], parts)
    if streams == "two":
        on_two_streams(ranges, rows, out.device)
    elif streams in ("hiA", "hiB"):
        one_range_high(ranges, rows, 0 if streams == "hiA" else 1)
    else:
        for lo, hi in ranges:
            rows(lo, hi)
    return out


def graph_us(fn, calls: int, replays: int = 20) -> float:
    graph = capture_graph(fn, calls)

    def many():
        for _ in range(replays):
            graph.replay()

    return time_eager(many, iters=20, warmup=2) / (replays * calls)


def row_for(B: int, names: list[str]) -> dict:
    row = {"B": B}
    for dt, sdt, nbytes in (("fp32", torch.float32, 4), ("bf16", torch.bfloat16, 2)):
        a = layer_inputs(B, sdt, seed=B)
        cfg = dict(decode_config(B, sdt))
        row[f"config_{dt}"] = cfg
        want = None
        for name in names:
            variant = VARIANTS[name]
            if isinstance(variant, dict) and variant.get("dot_sums") and sdt != torch.bfloat16:
                continue  # the tensor-core step takes a bf16 state only
            # every case starts from copies of the same states; its results are checked against the first's
            x = {**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()}
            call = (lambda x=x, v=variant: one_call(v, x, cfg))
            out = call()
            got = (out.clone(), x["conv_state"].clone(), x["state"].clone())
            want = want or got
            row[f"{dt}_{name}_maxdiff"] = max(float((p.float() - q.float()).abs().max()) for p, q in zip(got, want))
            for calls in (1, 10):
                us = graph_us(call, calls)
                row[f"{dt}_{name}_graph{calls}_us"] = us
                row[f"{dt}_{name}_graph{calls}_frac_copy"] = layer_bytes(B, nbytes) / us / 1e3
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,32,48,64,128,256")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--name", default="kda_decode_microbatch", help="the results file's name")
    ap.add_argument("--variants", default="", help="time only the variants matching this regular expression (and "
                    "the single launch, always first: the others are checked against it)")
    args = ap.parse_args()
    res = header() | {"copy_GBps": copy_bandwidth_GBps(), "rows": []}
    print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
    names = ["single"] + [n for n in VARIANTS if n != "single" and re.search(args.variants, n)]
    for B in (int(b) for b in args.batches.split(",")):
        row = row_for(B, names)
        for key in [k for k in row if k.endswith("_frac_copy")]:
            row[key] /= res["copy_GBps"]
        res["rows"].append(row)
        write_results(args.name, res, args.out)
        print(f"B={B}")
        for dt in ("fp32", "bf16"):
            for name in (n for n in names if f"{dt}_{n}_graph1_us" in row):
                print(f"  {dt} {name:12s} graph1 {row[f'{dt}_{name}_graph1_us']:7.1f} us "
                      f"({row[f'{dt}_{name}_graph1_frac_copy']:.3f})  graph10 {row[f'{dt}_{name}_graph10_us']:7.1f} us "
                      f"({row[f'{dt}_{name}_graph10_frac_copy']:.3f})  maxdiff {row[f'{dt}_{name}_maxdiff']:.1e}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
