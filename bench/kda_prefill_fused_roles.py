"""The state pass with kernel B's tiles formed inside it (``b_in_state``, kda_prefill_fused.py), split by role:
which of its two partitions sets the step?

One sequence of T tokens, H = 64, K = V = 128, after the gate pass and kernels D and A. Device time of the state
launch (ten back to back), per 64-token step, for:

- the shipped pair, kernel B then the Triton state pass (B's time and the pass's);
- the fused pass as built;
- its chain alone (``tile_role=1``: the tiles' partition only signals its barriers, so the chain reads whatever
  the ring holds) and its tiles alone (``tile_role=2``: the chain only signals); both give wrong outputs and
  time one partition each;
- the tiles' partition on 4 warps instead of 8.

    python3 bench/kda_prefill_fused_roles.py [--T 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, time_stream, write_results  # noqa: E402

from flashinfra.kernels import kda_prefill as pre  # noqa: E402
from flashinfra.kernels.kda_prefill_v3 import v3_launches  # noqa: E402

H, K = 64, 128
CONFIGS = [{}, {"b_in_state": True}, {"b_in_state": True, "tile_role": 1}, {"b_in_state": True, "tile_role": 2},
           {"b_in_state": True, "tile_warps": 4}, {"b_in_state": True, "tile_warps": 4, "tile_role": 2}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    T = args.T
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = (-5.0 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))).float()
    beta = torch.rand(T, H, device="cuda", generator=gen)
    o = torch.empty(T, H, K, dtype=torch.bfloat16, device="cuda")
    state = torch.zeros(1, H, K, K, device="cuda")
    cu, cu_t, slots_t, init_t = pre._seq_args([0, T], [0], [False], T, 1, q.device)
    res = header()
    res["T"], res["H"], res["rows"] = T, H, []
    for cfg in CONFIGS:
        launches = dict(v3_launches(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, None, BV=64, num_warps=4,
                                    num_stages=None, chain_precision="bf16x3", local_precision="tf32", **cfg))
        for name in ("gate", "intra_d", "intra_a"):
            launches[name]()
        row = {"config": cfg}
        for name in ("intra_b", "state"):
            if name in launches:
                launches[name]()
                us = time_stream(launches[name])
                row[f"{name}_us"], row[f"{name}_us_per_step"] = us, us / (T // 64)
        res["rows"].append(row)
        print(row, flush=True)
    write_results("kda_prefill_fused_roles", res, args.out)
    print(f"{'config':52s} {'B us/step':>10s} {'state us/step':>14s}")
    for row in res["rows"]:
        cfg = ",".join(f"{k}={v}" for k, v in row["config"].items()) or "B + Triton state pass"
        print(f"{cfg:52s} {row.get('intra_b_us_per_step', float('nan')):10.2f} {row['state_us_per_step']:14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
