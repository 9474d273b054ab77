"""KDA chunked prefill on the GPU against flash-linear-attention's chunk_kda, H=64, K=V=128, bf16 inputs:
T=8192, T=65536 and a packed batch of 16 sequences of mixed lengths (the anchors' shapes), in one run.

Ours: ``kda_prefill`` (gate and beta given, L2 norm fused) and ``kda_prefill_gated`` (gate, lower bound,
beta sigmoid and L2 norm fused). FLA: ``chunk_kda`` as the anchors ran it (g and beta given, no norm in the
kernel), and with the same fusions as ours (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``,
``safe_gate``, ``lower_bound``, ``use_beta_sigmoid_in_kernel``). Both write the final state.

    python bench/kda_prefill.py [--out DIR] [--variants]   -> bench/results/kda_prefill.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import fla_version, header, time_eager, write_results  # noqa: E402

from flashinfra.kernels.kda_prefill import kda_prefill_gated_launch, kda_prefill_launch  # noqa: E402

H, K, V, LB = 64, 128, 128, -5.0
VARLEN = [4096, 3000, 2500, 2048, 1500, 1200, 1000, 900, 700, 512, 400, 300, 200, 100, 64, 38]
VARIANTS = [dict(BV=32, num_warps=4), dict(BV=128, num_warps=4), dict(BV=64, num_warps=4),
            dict(BV=64, num_warps=4, num_stages=3), dict(BT=32, num_warps=4),
            dict(BV=64, num_warps=4, local_precision="tf32x3")]


def inputs(lens: list[int], seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    a = dict(q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, H, V), g_raw=rnd(T, H, K), beta_logits=rnd(T, H),
             A_log=rnd(H, dtype=torch.float32) * 0.3, dt_bias=rnd(H * K, dtype=torch.float32))
    a["g"] = (LB * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))).float()
    a["beta"] = torch.rand(T, H, device="cuda", generator=gen)
    a["cu"] = [0] + list(itertools.accumulate(lens))
    a["state"] = torch.randn(len(lens), H, K, V, device="cuda", generator=gen) * 0.1
    return a


def run_case(label: str, lens: list[int], variants: list[dict], res: dict, with_fla: bool):
    a = inputs(lens, seed=len(lens) + lens[0])
    T, N = sum(lens), len(lens)
    slots, init = list(range(N)), [True] * N
    row = {"case": label, "T": T, "num_seqs": N}

    def ours(**kw):
        return lambda: kda_prefill_launch(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], slots,
                                          init, **kw)

    def ours_gated(**kw):
        return lambda: kda_prefill_gated_launch(a["q"], a["k"], a["v"], a["g_raw"], a["beta_logits"], a["A_log"],
                                                a["dt_bias"], LB, a["state"], a["cu"], slots, init, **kw)

    cases = {"ours": ours(), "ours_gated": ours_gated()}
    for kw in variants:
        cases["ours_" + "_".join(f"{k}{v}" for k, v in kw.items())] = ours(**kw)
    try:
        if not with_fla:
            raise ImportError("FLA left out of this run (--no-fla)")
        from fla.ops.kda import chunk_kda

        cu = torch.tensor(a["cu"], device="cuda", dtype=torch.int32)
        q4, k4, v4 = (a[n].unsqueeze(0) for n in ("q", "k", "v"))
        kn = torch.nn.functional.normalize(a["k"].float(), dim=-1).bfloat16().unsqueeze(0)
        g4, b4 = a["g"].unsqueeze(0), a["beta"].bfloat16().unsqueeze(0)
        h0 = a["state"].clone()
        cases["fla_anchor_style"] = lambda: chunk_kda(q4, kn, v4, g4, b4, scale=K**-0.5, initial_state=h0,
                                                      output_final_state=True, cu_seqlens=cu)
        cases["fla_fused"] = lambda: chunk_kda(
            q4, k4, v4, a["g_raw"].unsqueeze(0), a["beta_logits"].unsqueeze(0), scale=K**-0.5, initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=a["A_log"],
            dt_bias=a["dt_bias"], cu_seqlens=cu)
    except ImportError as exc:
        row["fla_error"] = repr(exc)
    for name, fn in cases.items():
        t0 = time.time()
        try:
            fn()  # compiles (and autotunes, for FLA) outside the timing
            torch.cuda.synchronize()
            first = time.time() - t0
            us = time_eager(fn, iters=5 if T > 20000 else 10, warmup=1)
            row[f"{name}_ms"] = us / 1e3
            row[f"{name}_Mtok_s"] = T / us
            print(f"  {label} {name}: {us / 1e3:.3f} ms, {T / us:.2f} M tok/s (first call {first:.1f} s)", flush=True)
        except Exception as exc:
            row[f"{name}_error"] = repr(exc)[:300]
            print(f"  {label} {name}: error {exc!r}"[:400], flush=True)
    for ours_name, fla_name in (("ours", "fla_anchor_style"), ("ours_gated", "fla_fused")):
        if f"{ours_name}_ms" in row and f"{fla_name}_ms" in row:
            row[f"speedup_{ours_name}_vs_{fla_name}"] = row[f"{fla_name}_ms"] / row[f"{ours_name}_ms"]
    # Floors: bytes (inputs read once, output and state written once) and the state products' FLOPs.
    row["bytes"] = T * H * (2 * K * 2 + V * 2 + K * 4 + 4 + V * 2) + 2 * N * H * K * V * 4
    row["flops_state_products"] = 3 * 2 * T * H * K * V
    res.setdefault("rows", []).append(row)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--variants", action="store_true", help="also time block-size variants of our kernel")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA out (its autotuning takes minutes)")
    args = ap.parse_args()
    res = header()
    res["fla"] = fla_version()
    res["shape"] = dict(H=H, K=K, V=V)
    res["anchors_Mtok_s"] = {"T8192": 4.09, "T65536": 4.43, "varlen16": 4.35}
    run_case("T8192", [8192], VARIANTS if args.variants else [], res, not args.no_fla)
    run_case("varlen16", VARLEN, VARIANTS if args.variants else [], res, not args.no_fla)
    run_case("T65536", [65536], [], res, not args.no_fla)
    write_results("kda_prefill", res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
