"""The prefill's state pass alone, timed back to back on v3's scratch: which limit is it at?

Both state kernels (``kda_state64_kernel`` in kda_prefill_v3.py, Triton; ``kda_state64_gluon_kernel`` in
kda_prefill_state_gluon.py, Gluon), one sequence of T tokens, K = V = 128, value blocks of 64 (two programs per
head, one warpgroup each), for each chain precision:

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
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, time_stream, write_results  # noqa: E402

import flashinfra.kernels.kda_prefill_v3 as v3  # noqa: E402
from flashinfra.kernels import kda_prefill as pre  # noqa: E402
from flashinfra.kernels import kda_prefill_state_gluon as sg  # noqa: E402

K = V = 128
BV = 64


def scratch(T: int, H: int, chain: str) -> dict:
    """v3's first four launches on random inputs; the state pass's arguments as ``v3_launches`` passes them."""
    gen = torch.Generator(device="cuda").manual_seed(H)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = (-5.0 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))).float()
    beta = torch.rand(T, H, device="cuda", generator=gen)
    o = torch.empty(T, H, V, dtype=torch.bfloat16, device="cuda")
    state = torch.randn(1, H, K, V, device="cuda", generator=gen) * 0.1
    cu, cu_t, slots_t, init_t = pre._seq_args([0, T], [0], [True], T, 1, q.device)
    rec = {}
    launch = v3.state_pass_gluon
    v3.state_pass_gluon = lambda *a, **kw: rec.update(args=a, kw=kw)  # record the state pass's arguments
    try:
        for _, fn in v3.v3_launches(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, None, BV=BV,
                                    num_warps=4, num_stages=None, chain_precision=chain, local_precision="tf32",
                                    state_kernel="gluon"):
            fn()
    finally:
        v3.state_pass_gluon = launch
    torch.cuda.synchronize()
    return rec


def launchers(rec: dict, H: int, value_blocks: int) -> dict:
    """Both state kernels over the recorded scratch, on the first ``value_blocks`` value blocks of each head."""
    wqk, u, aqk, egl, o, state, cu_t, offsets_t, slots_t, init_t = rec["args"]
    kw = rec["kw"]
    grid = (value_blocks, H)
    consts = dict(H=H, K=K, V=V, BV=BV, CHAIN=kw["chain"], **kw["slots"], A_LO=kw["a_lo"], num_warps=4)
    descs = sg.descriptors(wqk, u, aqk, egl, K, BV)
    tr = (TensorDescriptor.from_tensor(wqk.view(-1, K), [64, K]), TensorDescriptor.from_tensor(u.view(-1, 64), [BV, 64]),
          TensorDescriptor.from_tensor(aqk.view(-1, 64), [64, 64]))
    state_d = TensorDescriptor.from_tensor(state.view(-1, V), [K, BV])
    return {
        "gluon": lambda: sg.kda_state64_gluon_kernel[grid](*descs, o, state, cu_t, offsets_t, slots_t, init_t,
                                                           STAGES=kw["stages"], **consts),
        "triton": lambda: v3.kda_state64_kernel[grid](*tr, egl, o, state_d, cu_t, offsets_t, slots_t, init_t,
                                                      OUT_X3=False, DOT_F32=False, num_stages=kw["stages"], **consts),
    }


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
                for name, fn in launchers(rec, H, blocks).items():
                    us = time_stream(fn)
                    row = dict(chain=chain, H=H, T=args.T, value_blocks=blocks, programs=blocks * H, kernel=name,
                               us=us, us_per_step=us / (args.T // 64))
                    res["rows"].append(row)
                    print(row, flush=True)
            del rec
    write_results(args.name, res, args.out)
    print(f"{'chain':7s} {'H':>3s} {'blocks':>6s} {'programs':>8s} {'triton us':>10s} {'gluon us':>9s} "
          f"{'per step':>9s}")
    rows = {(r["chain"], r["H"], r["value_blocks"], r["kernel"]): r for r in res["rows"]}
    for (chain, H, blocks, name), r in rows.items():
        if name == "triton":
            g = rows[(chain, H, blocks, "gluon")]
            print(f"{chain:7s} {H:3d} {blocks:6d} {r['programs']:8d} {r['us']:10.1f} {g['us']:9.1f} "
                  f"{r['us_per_step']:5.2f}/{g['us_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
