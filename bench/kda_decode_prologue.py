"""What the bare KDA decode recurrence's prologue costs: the q/k L2 norms before the state step. The recurrence
(``kda_decode_kernel``'s body, rebuilt here with a MODE switch) is timed in a CUDA graph at its defaults' block
shapes (fp32 state [K, 64] on 4 warps, bf16 [K, 32] on 2), H=64, K=V=128, B=16 / 64 / 256:

- mode 0: as shipped (two reductions, one per norm);
- mode 1: no norms at all (q times the scale, k as is: a wrong result, timed only, to bound what the norms cost);
- mode 2: both sums of squares in one reduction (one barrier pass instead of two);
- mode 3: as 2, with q's factor applied to the [BV] output instead of the [K] vector;
- mode 0 with the small loads (q, k, v, g, beta) read with the L2 policy evict_first, as the layer's tile kernel
  reads its prep scratch.

Modes 0, 2 and 3 are checked against the float32 reference ``kda_decode_ref`` on a fresh copy of the state, the
output poisoned with NaN, before any timing (largest absolute error of the output and of the new state).

    python bench/kda_decode_prologue.py [--out DIR] -> bench/results/kda_decode_prologue.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, time_graph, write_results  # noqa: E402

from flashinfra.kernels.kda.decode_recurrence import kda_decode_launch, kda_decode_ref  # noqa: E402
from flashinfra.kernels.kda.common import load_state, state_step, state_tile  # noqa: E402


@triton.jit
def _add2(a, b, c, d):
    return a + c, b + d


@triton.jit
def prologue_kernel(q, k, v, g, beta, o, state, state_slots, scale,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, MODE: tl.constexpr,
                    EVICT: tl.constexpr = ""):
    """Grid (V // BV, B * H); q, k, v, o contiguous [B, H, D], g float32 [B, H, K], beta [B, H]; EVICT: the L2
    policy of the small loads (q, k, v, g, beta)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_h = i_bh % H
    slot = tl.load(state_slots + i_bh // H).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s, m_s = state_tile(state, slot, i_h, o_k, o_v, H, K, V)
    b_s = load_state(p_s, m_s).to(tl.float32)
    b_q = tl.load(q + i_bh * K + o_k, eviction_policy=EVICT)
    b_k = tl.load(k + i_bh * K + o_k, eviction_policy=EVICT)
    b_v = tl.load(v + i_bh * V + o_v, eviction_policy=EVICT)
    b_g = tl.load(g + i_bh * K + o_k, eviction_policy=EVICT)
    b_beta = tl.load(beta + i_bh, eviction_policy=EVICT)
    b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    if MODE == 1:
        r_q = scale
        r_k = 1.0
    elif MODE >= 2:
        sq, sk = tl.reduce((b_q * b_q, b_k * b_k), 0, _add2)
        r_q = scale / tl.sqrt(sq + 1e-6)
        r_k = 1.0 / tl.sqrt(sk + 1e-6)
    else:
        r_q = scale / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        r_k = 1.0 / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    if MODE == 3:
        b_s, b_o = state_step(b_s, b_q, b_k * r_k, tl.exp(b_g), b_beta.to(tl.float32), b_v.to(tl.float32))
        b_o = b_o * r_q
    else:
        b_s, b_o = state_step(b_s, b_q * r_q, b_k * r_k, tl.exp(b_g), b_beta.to(tl.float32), b_v.to(tl.float32))
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty))
    tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)


def time_case(q, k, v, g, beta, slots, s, BV: int, num_warps: int) -> dict:
    """Errors of modes 0, 2, 3 against the reference, then every mode and the shipped launch timed in a graph, on
    the state ``s`` ([B, H, K, V], updated in place by the timed calls)."""
    B, H, K = q.shape
    V = v.shape[-1]
    o = torch.empty(B, H, V, device="cuda", dtype=torch.bfloat16)

    def launch(mode, state, evict=""):
        prologue_kernel[(V // BV, B * H)](q, k, v, g, beta, o, state, slots, K**-0.5, H=H, K=K, V=V, BV=BV, MODE=mode,
                                          EVICT=evict, num_warps=num_warps)

    row = {}
    for mode in (0, 2, 3):
        ours, ref = s.clone(), s.clone()
        o.fill_(float("nan"))
        launch(mode, ours)
        o_ref = kda_decode_ref(q, k, v, g, beta, ref, slots)
        row[f"mode{mode}_err_out"] = (o.float() - o_ref.float()).abs().max().item()
        row[f"mode{mode}_err_state"] = (ours.float() - ref.float()).abs().max().item()
    row["default_graph_us"] = time_graph(lambda: kda_decode_launch(q, k, v, g, beta, s, slots, out=o))
    for mode in (0, 1, 2, 3):
        row[f"mode{mode}_graph_us"] = time_graph(lambda m=mode: launch(m, s))
    row["mode0_evict_first_graph_us"] = time_graph(lambda: launch(0, s, "evict_first"))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="also copy the JSON into this folder")
    args = ap.parse_args()
    torch.manual_seed(0)
    H, K, V = 64, 128, 128
    res = {**header(), "shape": dict(H=H, K=K, V=V), "rows": {}}
    for B in (64, 256, 16):
        q, k, v = (torch.randn(B, H, n, device="cuda", dtype=torch.bfloat16) for n in (K, K, V))
        g = -torch.rand(B, H, K, device="cuda") * 0.1
        beta = torch.rand(B, H, device="cuda")
        slots = torch.randperm(B, device="cuda")
        st = (torch.randn(B, H, K, V, device="cuda") * 0.1).to(torch.bfloat16)
        for dt in ("bf16", "fp32"):
            s = st.clone() if dt == "bf16" else st.float()
            row = time_case(q, k, v, g, beta, slots, s, *((32, 2) if dt == "bf16" else (64, 4)))
            res["rows"][f"{dt}_B{B}"] = row
            print(dt, B, " ".join(f"{key}={x:.3g}" for key, x in row.items()), flush=True)
    print(write_results("kda_decode_prologue", res, args.out))


if __name__ == "__main__":
    main()
