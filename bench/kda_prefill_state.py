"""The prefill's state pass alone, timed back to back on v3's scratch: which limit is it at?

``kda_state64_kernel`` (kda_prefill_v3.py), one sequence of T tokens, K = V = 128, value blocks of 64 (two
programs per head, one warpgroup each), for each chain precision:

- the whole grid, at H = 64, 32 and 16 heads (128, 64 and 32 programs, each on its own SM): a program bound by
  its own chain of products takes the same time at every H; a pass bound by a bandwidth the programs share
  (DRAM or the L2) gets faster as H falls;
- the first value block of each head only (half the programs, the same per-program work): the two
  value blocks of a head read the same w, qg, kd and Aqk tiles, so with one of them the L2 serves half the
  bytes.

    python3 bench/kda_prefill_state.py [--T 8192] [--heads 64,32,16] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, time_stream, write_results  # noqa: E402

import flashinfra.kernels.kda_prefill_v3 as v3  # noqa: E402
from flashinfra.kernels import kda_prefill as pre  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--heads", default="64,32,16")
    ap.add_argument("--chains", default="bf16x3,bf16x2")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--name", default="kda_prefill_state")
    args = ap.parse_args()
    res = header()
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
