"""The prefill's state pass alone, timed back to back on v3's scratch: which limit is it at?

``kda_state64_kernel`` (kda_prefill_state_pass.py), one sequence of T tokens, K = V = 128, value blocks of 64 (two
programs per head, one warpgroup each), for each chain precision:

- the whole grid, at H = 64, 32 and 16 heads (128, 64 and 32 programs, each on its own SM): a program bound by
  its own chain of products takes the same time at every H; a pass bound by a bandwidth the programs share
  (DRAM or the L2) gets faster as H falls;
- the first value block of each head only (half the programs, the same per-program work): the two
  value blocks of a head read the same w, qg, kd and Aqk tiles, so with one of them the L2 serves half the
  bytes.

    python3 bench/kda_prefill_state.py [--T 8192] [--heads 64,32,16] [--out DIR]

With ``--tiles`` it asks instead how much of a step is its tiles' arrival, at H = 64 for each T of ``--Ts``: the pass
with its L2 prefetch off, one and two steps ahead (``L2_AHEAD``), and a copy of the kernel whose every step reads
the first chunk's tiles (so that they always come from the L2; its outputs are meaningless), the four interleaved
over ``--rounds`` rounds:

    python3 bench/kda_prefill_state.py --tiles [--Ts 8192,65536] [--rounds 4] --name kda_prefill_state_tiles
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, time_stream, write_results  # noqa: E402

import flashinfra.kernels.kda.prefill_state as state_pass  # noqa: E402
import flashinfra.kernels.kda.prefill_launch as v3  # noqa: E402
from flashinfra.kernels.kda import prefill as pre  # noqa: E402

K = V = 128
BV = 64


class _Recorded:
    """Stands in for the state kernel while v3's launches run: keeps the arguments of its one launch."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
        return launch


def scratch(T: int, H: int, chain: str) -> _Recorded:
    """v3's first four launches on random inputs, and the state pass's launch as ``v3_launches`` makes it."""
    gen = torch.Generator(device="cuda").manual_seed(H)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = (-5.0 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))).float()
    beta = torch.rand(T, H, device="cuda", generator=gen)
    o = torch.empty(T, H, V, dtype=torch.bfloat16, device="cuda")
    state = torch.randn(1, H, K, V, device="cuda", generator=gen) * 0.1
    cu, cu_t, slots_t, init_t = pre._seq_args([0, T], [0], [True], T, 1, q.device)
    rec, kernel = _Recorded(), v3.kda_state64_kernel
    v3.kda_state64_kernel = rec
    try:
        for _, fn in v3.v3_launches(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, None, BV=BV,
                                    num_warps=4, num_stages=None, chain_precision=chain, local_precision="tf32"):
            fn()
    finally:
        v3.kda_state64_kernel = kernel
    torch.cuda.synchronize()
    return rec


def launcher(rec: _Recorded, value_blocks: int):
    """The state kernel over the recorded scratch, on the first ``value_blocks`` value blocks of each head."""
    return lambda: v3.kda_state64_kernel[(value_blocks, rec.grid[1])](*rec.args, **rec.kwargs)


def first_chunk_kernel():
    """A copy of ``kda_state64_kernel`` whose every step reads the first chunk's tiles (for ``--tiles`` only)."""
    src = open(state_pass.__file__).read()
    step = "        base = (c0 + i_t) * H + i_h\n"
    if step not in src:
        raise RuntimeError("kda_state64_kernel's step no longer forms `base` as this probe expects")
    path = os.path.join(tempfile.mkdtemp(), "kda_prefill_state_pass_first_chunk.py")
    with open(path, "w") as f:
        f.write(src.replace(step, "        base = c0 * H + i_h\n"))
    spec = importlib.util.spec_from_file_location("kda_prefill_state_pass_first_chunk", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kda_state64_kernel


def tiles(Ts: list[int], chains: list[str], rounds: int) -> list[dict]:
    """The ``--tiles`` rows: per T and chain, each variant's time in every round (interleaved) and its median."""
    first = first_chunk_kernel()
    rows = []
    for T in Ts:
        for chain in chains:
            rec = scratch(T, 64, chain)
            grid = (V // BV, rec.grid[1])
            variants = {"l2_ahead_0": (v3.kda_state64_kernel, {"L2_AHEAD": 0}),
                        "l2_ahead_1": (v3.kda_state64_kernel, {"L2_AHEAD": 1}),
                        "l2_ahead_2": (v3.kda_state64_kernel, {"L2_AHEAD": 2}),
                        "first_chunk_tiles": (first, {"L2_AHEAD": 0})}
            fns = {n: (lambda k=k, kw=kw: k[grid](*rec.args, **{**rec.kwargs, **kw})) for n, (k, kw) in
                   variants.items()}
            for fn in fns.values():
                fn()
            torch.cuda.synchronize()
            times = {n: [] for n in fns}
            for _ in range(rounds):
                for n, fn in fns.items():
                    times[n].append(time_stream(fn, calls=max(1, 80000 // T)))
            for n, ts in times.items():
                med = sorted(ts)[len(ts) // 2]
                rows.append(dict(T=T, chain=chain, variant=n, us=ts, median_us=med, us_per_step=med / (T // 64)))
                print(rows[-1], flush=True)
            del rec
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--heads", default="64,32,16")
    ap.add_argument("--chains", default="bf16x3,bf16x2")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--name", default="kda_prefill_state")
    ap.add_argument("--tiles", action="store_true", help="time the L2 prefetch options and the first-chunk copy")
    ap.add_argument("--Ts", default="8192,65536")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    res = header()
    if args.tiles:
        res["tiles"] = tiles([int(t) for t in args.Ts.split(",")], args.chains.split(","), args.rounds)
        write_results(args.name, res, args.out)
        print(f"{'T':>6s} {'chain':7s} {'variant':18s} {'median us':>9s} {'us per step':>11s}")
        for r in res["tiles"]:
            print(f"{r['T']:6d} {r['chain']:7s} {r['variant']:18s} {r['median_us']:9.1f} {r['us_per_step']:11.2f}")
        return 0
    res["rows"] = []
    for chain in args.chains.split(","):
        for H in (int(h) for h in args.heads.split(",")):
            rec = scratch(args.T, H, chain)
            for blocks in (V // BV, 1):
                us = time_stream(launcher(rec, blocks))
                row = dict(chain=chain, H=H, T=args.T, value_blocks=blocks, programs=blocks * H, us=us,
                           us_per_step=us / (args.T // 64))
                res["rows"].append(row)
                print(row, flush=True)
            del rec
    write_results(args.name, res, args.out)
    print(f"{'chain':7s} {'H':>3s} {'blocks':>6s} {'programs':>8s} {'us':>8s} {'us per step':>11s}")
    for r in res["rows"]:
        print(f"{r['chain']:7s} {r['H']:3d} {r['value_blocks']:6d} {r['programs']:8d} {r['us']:8.1f} "
              f"{r['us_per_step']:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
