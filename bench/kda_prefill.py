"""KDA chunked prefill on the GPU against flash-linear-attention's chunk_kda, H=64, K=V=128, bf16 inputs:
T=8192, T=65536 and a packed batch of 16 sequences of mixed lengths (the anchors' shapes), in one run.

Ours: ``kda_prefill`` (gate and beta given, L2 norm fused) and ``kda_prefill_gated`` (gate, lower bound,
beta sigmoid and L2 norm fused), the default version (v3, 64-token chunks) with its tuning variants, and v2
(16-token chunks). Precision, same run: each output against the v2 kernel with every product in ieee fp32 and an fp32
output (at fp32 rounding against float64, bench/notes/kda_precision.md), for ours and for FLA with the L2
norm in its kernel. FLA: ``chunk_kda`` as the anchors ran it (g and beta given, no norm in the
kernel), and with the same fusions as ours (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``,
``safe_gate``, ``lower_bound``, ``use_beta_sigmoid_in_kernel``). Both write the final state.

    python bench/kda_prefill.py [--out DIR] [--variants] [--fla-fused] [--name kda_prefill]
        -> bench/results/<name>.json, a short table last
    python bench/kda_prefill.py --parts [--fla] [--configs JSON] [--name kda_prefill_v3_parts]
        v3's launches timed one by one (PART_CONFIGS, or the JSON list; the gate pass is the first part),
        their sum as queued launches (``total``) and the whole call (``call``: argument checks, index
        tensors and scratch included, as FLA's call is timed; the ratio to FLA uses it), v2 beside them,
        FLA's chunk_kda (anchor style) with --fla; compile first, side by side:
        for w in 0 1 2 v3_gated v2 v2_ieee v2_gated_ieee; do
            python bench/kda_prefill.py --warm $w & done; wait

The anchor-style FLA call leaves q unnormalised (as the anchors ran it), so it computes another function and
gets no precision entry; ``fla_norm`` (norm in FLA's kernel) is the precision comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import fla_version, header, time_eager, time_stream, write_results  # noqa: E402

from flashinfra.kernels.kda import prefill as pre  # noqa: E402
from flashinfra.kernels.kda.prefill import kda_prefill_gated_launch, kda_prefill_launch  # noqa: E402
from flashinfra.kernels.kda.prefill_launch import v3_launches  # noqa: E402

H, K, V, LB = 64, 128, 128, -5.0
VARLEN = [4096, 3000, 2500, 2048, 1500, 1200, 1000, 900, 700, 512, 400, 300, 200, 100, 64, 38]
V2 = {"version": "v2"}
# --variants: the default (v3) at other tuning options, whole calls
VARIANTS = [{"BV": 32}, {"b_block": 64}, {"KS": 16, "d_warps": 1}, {"chain_precision": "bf16x3"}]
# --parts: v3's launches timed one by one, at the defaults and at options over them ("bf16x2": w and kd as one
# bf16 each, which leaves shared memory for 3 pipeline stages of the state pass's tiles; with 2)
PART_CONFIGS = [{}, {"chain_precision": "bf16x2"}, {"chain_precision": "bf16x2", "num_stages": 2}]
ITERS: list[int] = []  # --iters: timed calls per median, else 10 (5 past 20k tokens)


def iters_for(T: int) -> int:
    return ITERS[0] if ITERS else 5 if T > 20000 else 10
WARM = {str(i): cfg for i, cfg in enumerate(PART_CONFIGS)}


def inputs(lens: list[int], seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    a = dict(q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, H, V), g_raw=rnd(T, H, K), beta_logits=rnd(T, H),
             A_log=rnd(H, dtype=torch.float32) * 0.3, dt_bias=rnd(H * K, dtype=torch.float32))
    a["g"] = (LB * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))).float()
    a["beta"] = torch.rand(T, H, device="cuda", generator=gen).bfloat16().float()  # exact for FLA's bf16 beta
    a["cu"] = [0] + list(itertools.accumulate(lens))
    a["state"] = torch.randn(len(lens), H, K, V, device="cuda", generator=gen) * 0.1
    return a


def _name(kw: dict) -> str:
    return "ours_" + "_".join(f"{k}{v}" if k != "version" else v for k, v in kw.items())


def run_case(label: str, lens: list[int], variants: list[dict], res: dict, with_fla: bool, fla_fused: bool):
    a = inputs(lens, seed=len(lens) + lens[0])
    T, N = sum(lens), len(lens)
    slots, init = list(range(N)), [True] * N
    row = {"case": label, "T": T, "num_seqs": N}
    s0 = a["state"].clone()

    def ours(**kw):
        return lambda: kda_prefill_launch(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], slots,
                                          init, **kw)

    def ours_gated(**kw):
        return lambda: kda_prefill_gated_launch(a["q"], a["k"], a["v"], a["g_raw"], a["beta_logits"], a["A_log"],
                                                a["dt_bias"], LB, a["state"], a["cu"], slots, init, **kw)

    cases = {"ours": ours(), "ours_gated": ours_gated(), "ours_v2": ours(**V2), "ours_v2_gated": ours_gated(**V2)}
    for kw in variants:
        cases[_name(kw)] = ours(**kw)
    outputs = {}
    try:
        if not with_fla:
            raise ImportError("FLA left out of this run (--no-fla)")
        from fla.ops.kda import chunk_kda

        cu = torch.tensor(a["cu"], device="cuda", dtype=torch.int32)
        q4, k4, v4 = (a[n].unsqueeze(0) for n in ("q", "k", "v"))
        kn = torch.nn.functional.normalize(a["k"].float(), dim=-1).bfloat16().unsqueeze(0)
        g4, b4 = a["g"].unsqueeze(0), a["beta"].bfloat16().unsqueeze(0)
        h0 = s0.clone()
        cases["fla_anchor_style"] = lambda: chunk_kda(q4, kn, v4, g4, b4, scale=K**-0.5, initial_state=h0,
                                                      output_final_state=True, cu_seqlens=cu)
        cases["fla_norm"] = lambda: chunk_kda(q4, k4, v4, g4, b4, scale=K**-0.5, initial_state=h0,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        if fla_fused:
            cases["fla_fused"] = lambda: chunk_kda(
                q4, k4, v4, a["g_raw"].unsqueeze(0), a["beta_logits"].unsqueeze(0), scale=K**-0.5,
                initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=a["A_log"],
                dt_bias=a["dt_bias"], cu_seqlens=cu)
    except ImportError as exc:
        row["fla_error"] = repr(exc)
    for name, fn in cases.items():
        t0 = time.time()
        a["state"].copy_(s0)  # each first call starts from the same initial state (ours write it in place)
        try:
            out = fn()  # compiles (and autotunes, for FLA) outside the timing
            torch.cuda.synchronize()
            if name in ("ours", "ours_v2", "fla_norm"):
                outputs[name] = (out[0][0] if isinstance(out, tuple) else out).float()
            first = time.time() - t0
            us = time_eager(fn, iters=iters_for(T), warmup=1)
            row[f"{name}_ms"] = us / 1e3
            row[f"{name}_Mtok_s"] = T / us
            print(f"  {label} {name}: {us / 1e3:.3f} ms, {T / us:.2f} M tok/s (first call {first:.1f} s)", flush=True)
        except Exception as exc:
            row[f"{name}_error"] = repr(exc)[:300]
            print(f"  {label} {name}: error {exc!r}"[:400], flush=True)
    # precision: against v2 with every product in ieee fp32 and an fp32 output (same inputs, same initial state)
    ref = kda_prefill_launch(a["q"].float(), a["k"], a["v"], a["g"], a["beta"], s0.clone(), a["cu"], slots,
                             init, chain_precision="ieee", local_precision="ieee", version="v2")
    for name, out in outputs.items():
        row[f"{name}_relerr_vs_ieee"] = float((out - ref).norm() / ref.norm())
    del ref, outputs
    for ours_name, fla_name in (("ours", "fla_anchor_style"), ("ours_v2", "fla_anchor_style"),
                                ("ours_gated", "fla_fused"), ("ours_v2_gated", "fla_fused")):
        if f"{ours_name}_ms" in row and f"{fla_name}_ms" in row:
            row[f"speedup_{ours_name}_vs_{fla_name}"] = row[f"{fla_name}_ms"] / row[f"{ours_name}_ms"]
    # Floors: bytes (inputs read once, output and state written once) and the state products' FLOPs.
    row["bytes"] = T * H * (2 * K * 2 + V * 2 + K * 4 + 4 + V * 2) + 2 * N * H * K * V * 4
    row["flops_state_products"] = 3 * 2 * T * H * K * V
    res.setdefault("rows", []).append(row)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def time_fla(a: dict, s0: torch.Tensor, iters: int) -> dict:
    """FLA's chunk_kda as the anchors ran it (k normalised outside, g and beta given), final state written;
    its first call autotunes (a minute or more per shape), outside the timing."""
    out = {}
    try:
        from fla.ops.kda import chunk_kda

        cu = torch.tensor(a["cu"], device="cuda", dtype=torch.int32)
        q4, v4 = a["q"].unsqueeze(0), a["v"].unsqueeze(0)
        kn = torch.nn.functional.normalize(a["k"].float(), dim=-1).bfloat16().unsqueeze(0)
        g4, b4 = a["g"].unsqueeze(0), a["beta"].bfloat16().unsqueeze(0)
        h0 = s0.clone()

        def fla():
            return chunk_kda(q4, kn, v4, g4, b4, scale=K**-0.5, initial_state=h0, output_final_state=True,
                             cu_seqlens=cu)

        t0 = time.time()
        fla()
        torch.cuda.synchronize()
        out["fla_first_call_s"] = time.time() - t0
        out["fla_ms"] = time_eager(fla, iters=iters, warmup=1) / 1e3
    except Exception as exc:  # FLA missing, or its call failing, leaves a note in the row
        out["fla_error"] = repr(exc)[:300]
    return out


def time_parts(label: str, lens: list[int], res: dict, with_fla: bool = False) -> None:
    """v3's launches one by one (the gate pass, in-chunk matrices, per-chunk tiles, state
    pass) and together, per config, with the output's and final state's error against v2 in ieee fp32 (fp32
    output), the gated op's error likewise and its time (bf16 activations, whole calls), and v2's total (and
    FLA's with ``with_fla``) in the same run."""
    a = inputs(lens, seed=len(lens) + lens[0])
    T, N = sum(lens), len(lens)
    slots, init = list(range(N)), [True] * N
    s0 = a["state"].clone()
    ref_s = s0.clone()
    ref = kda_prefill_launch(a["q"].float(), a["k"], a["v"], a["g"], a["beta"], ref_s, a["cu"], slots, init,
                             chain_precision="ieee", local_precision="ieee", version="v2")
    gated_args = (a["q"].float(), a["k"], a["v"], a["g_raw"], a["beta_logits"], a["A_log"], a["dt_bias"], LB)
    gated_ref = kda_prefill_gated_launch(*gated_args, s0.clone(), a["cu"], slots, init, chain_precision="ieee",
                                         local_precision="ieee", version="v2")
    gated_v3 = kda_prefill_gated_launch(*gated_args, s0.clone(), a["cu"], slots, init, version="v3")
    gated_err = float((gated_v3 - gated_ref).norm() / gated_ref.norm())
    del gated_v3
    iters = iters_for(T)
    v2_us = time_eager(lambda: kda_prefill_launch(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"],
                                                  slots, init, version="v2"), iters=iters, warmup=1)
    fla = time_fla(a, s0, iters) if with_fla else {}
    cu, cu_t, slots_t, init_t = pre._seq_args(a["cu"], slots, init, T, N, a["q"].device)
    o = torch.empty(T, H, V, dtype=torch.bfloat16, device="cuda")
    for cfg in PART_CONFIGS:
        opts = dict(BV=64, num_warps=4, num_stages=None, chain_precision=pre.V3_CHAIN, local_precision="tf32") | cfg
        row = {"case": label, "T": T, "config": cfg, "v2_ms": v2_us / 1e3, "v3_gated_relerr_vs_ieee": gated_err,
               **fla}
        try:
            a["state"].copy_(s0)
            o.fill_(float("nan"))  # an element left unwritten shows as a NaN error
            launches = list(v3_launches(a["q"], a["k"], a["v"], a["g"], a["beta"], o, a["state"], cu, cu_t,
                                        slots_t, init_t, None, **opts))
            for _, fn in launches:
                fn()
            torch.cuda.synchronize()
            row["relerr_vs_ieee"] = float((o.float() - ref).norm() / ref.norm())
            row["state_relerr_vs_ieee"] = float((a["state"] - ref_s).norm() / ref_s.norm())
            for name, fn in launches:
                row[f"{name}_ms"] = time_eager(fn, iters=iters, warmup=1) / 1e3
                row[f"{name}_stream_ms"] = time_stream(fn) / 1e3  # device time: ten calls back to back
            row["total_ms"] = time_eager(lambda: [fn() for _, fn in launches], iters=iters, warmup=1) / 1e3
            # the whole call, as FLA is timed: argument checks, index tensors and scratch included
            row["call_ms"] = time_eager(lambda: kda_prefill_launch(
                a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], slots, init, version="v3", **opts),
                iters=iters, warmup=1) / 1e3
            row["Mtok_s"] = T / row["call_ms"] / 1e3
            if "fla_ms" in row:
                row["speedup_vs_fla"] = row["fla_ms"] / row["call_ms"]
            if cfg != PART_CONFIGS[0]:  # the gated op at other options, same comparison as v3_gated_relerr_vs_ieee
                gated = kda_prefill_gated_launch(*gated_args, s0.clone(), a["cu"], slots, init, version="v3", **cfg)
                row["gated_relerr_vs_ieee"] = float((gated - gated_ref).norm() / gated_ref.norm())
                del gated
            # the gated op as the model calls it (bf16 activations and raw gate)
            row["gated_ms"] = time_eager(lambda: kda_prefill_gated_launch(
                a["q"], a["k"], a["v"], a["g_raw"], a["beta_logits"], a["A_log"], a["dt_bias"], LB, a["state"],
                a["cu"], slots, init, version="v3", **cfg), iters=iters, warmup=1) / 1e3
        except Exception as exc:
            row["error"] = repr(exc)[:300]
        res.setdefault("parts", []).append(row)
        print(row, flush=True)
    del ref, gated_ref


def warm(name: str) -> None:
    """Compile (into Triton's on-disk cache) the kernels that --parts runs, at one tiny batch with the same
    argument types, so that several processes can compile them side by side first."""
    a = inputs([64, 40], seed=0)
    slots, init = [0, 1], [True, True]
    gated = (a["q"].float(), a["k"], a["v"], a["g_raw"], a["beta_logits"], a["A_log"], a["dt_bias"], LB, a["state"],
             a["cu"], slots, init)
    plain = (a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], slots, init)

    def config(cfg):  # the plain op, and the gated op with float32 q (its error) and bf16 q (its time)
        kda_prefill_launch(a["q"], *plain, version="v3", **cfg)
        kda_prefill_gated_launch(*gated, version="v3", **cfg)
        kda_prefill_gated_launch(a["q"], *gated[1:], version="v3", **cfg)

    calls = {n: (lambda cfg=cfg: config(cfg)) for n, cfg in WARM.items()}
    calls |= {"v3_gated": lambda: kda_prefill_gated_launch(*gated, version="v3"),
              "v2": lambda: kda_prefill_launch(a["q"], *plain, version="v2"),
              "v2_ieee": lambda: kda_prefill_launch(a["q"].float(), *plain, chain_precision="ieee",
                                                    local_precision="ieee", version="v2"),
              "v2_gated_ieee": lambda: kda_prefill_gated_launch(*gated, chain_precision="ieee",
                                                                local_precision="ieee", version="v2")}
    calls[name]()
    torch.cuda.synchronize()


def print_parts(res: dict) -> None:
    print(f"{'case':9s} {'config':44s} {'gate':>6s} {'D ms':>6s} {'A ms':>6s} {'B ms':>6s} {'state':>7s} "
          f"{'total':>7s} {'call':>7s} {'v2':>7s} {'FLA':>7s} {'FLA/call':>8s} {'err':>8s} {'state':>8s} {'gated':>8s} {'gated cfg':>9s} "
          f"{'gated ms':>8s}")
    for r in res.get("parts", []):
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items()) or "default"
        nan = float("nan")
        a_ms = r.get("intra_a_ms", r.get("intra_ms", nan))
        print(f"{r['case']:9s} {cfg:44s} {r.get('gate_ms', 0):6.3f} {r.get('intra_d_ms', 0):6.3f} {a_ms:6.3f} "
              f"{r.get('intra_b_ms', 0):6.3f} "
              f"{r.get('state_ms', nan):7.3f} {r.get('total_ms', nan):7.3f} {r.get('call_ms', nan):7.3f} "
              f"{r['v2_ms']:7.3f} {r.get('fla_ms', nan):7.3f} {r.get('speedup_vs_fla', nan):8.3f} "
              f"{r.get('relerr_vs_ieee', nan):8.2e} {r.get('state_relerr_vs_ieee', nan):8.2e} "
              f"{r['v3_gated_relerr_vs_ieee']:8.2e} {r.get('gated_relerr_vs_ieee', nan):9.2e} "
              f"{r.get('gated_ms', nan):8.3f} "
              f"{r.get('error', '')[:60]}")


def print_stream(res: dict) -> None:
    """Each launch's device time (ten calls back to back, ``time_stream``) beside the single-call times above."""
    names = ("gate", "intra_d", "intra_a", "intra_b", "state")
    print(f"{'case':9s} {'config':44s} " + " ".join(f"{n:>8s}" for n in names) + "  (ms, back to back)")
    for r in res.get("parts", []):
        cfg = ",".join(f"{k}={v}" for k, v in r["config"].items()) or "default"
        print(f"{r['case']:9s} {cfg:44s} " + " ".join(f"{r.get(n + '_stream_ms', float('nan')):8.3f}" for n in names))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--variants", action="store_true", help="also time block-size variants of our kernel")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA out (its autotuning takes minutes)")
    ap.add_argument("--fla-fused", action="store_true", help="also time FLA with the gate and beta in its kernel")
    ap.add_argument("--name", default="kda_prefill", help="result file name in bench/results/")
    ap.add_argument("--cases", default="T8192,varlen16,T65536")
    ap.add_argument("--iters", type=int, help="timed calls per median (10, or 5 past 20k tokens)")
    ap.add_argument("--parts", action="store_true", help="only time v3's launches one by one (see time_parts)")
    ap.add_argument("--fla", action="store_true", help="with --parts: also time FLA's chunk_kda (autotunes first)")
    ap.add_argument("--warm", help="only compile the kernels of one --parts call: v3, v3_gated, v2, v2_ieee, ...")
    ap.add_argument("--configs", help="with --parts or --warm: a JSON list of v3 configs instead of PART_CONFIGS "
                                      "(--warm NAME compiles the config at index NAME)")
    args = ap.parse_args()
    if args.iters:
        ITERS.append(args.iters)
    if args.configs:
        PART_CONFIGS[:] = json.loads(args.configs)
    if args.warm:
        if args.configs:
            WARM[args.warm] = PART_CONFIGS[int(args.warm)]
        warm(args.warm)
        return 0
    res = header()
    res["fla"] = fla_version()
    res["shape"] = dict(H=H, K=K, V=V)
    res["anchors_Mtok_s"] = {"T8192": 4.09, "T65536": 4.43, "varlen16": 4.35}
    shapes = {"T8192": [8192], "varlen16": VARLEN, "T65536": [65536]}
    if args.parts:
        for label in args.cases.split(","):
            time_parts(label, shapes[label], res, args.fla)
            write_results(args.name, res, args.out)
        print_parts(res)
        print_stream(res)
        return 0
    for label in args.cases.split(","):
        run_case(label, shapes[label], VARIANTS if args.variants else [], res, not args.no_fla, args.fla_fused)
        write_results(args.name, res, args.out)  # after each case, so that a cut-off run keeps what it measured
    print_table(res)
    return 0


def print_table(res: dict) -> None:
    nan = float("nan")
    print(f"{'case':9s} {'ours ms':>8s} {'v2 ms':>7s} {'FLA ms':>7s} {'FLA/ours':>8s} {'M tok/s':>8s} "
          f"{'gated':>7s} {'err ours':>8s} {'err v2':>8s} {'err FLA':>8s}")
    for r in res["rows"]:
        ours, fla = r.get("ours_ms", nan), r.get("fla_anchor_style_ms", nan)
        print(f"{r['case']:9s} {ours:8.3f} {r.get('ours_v2_ms', nan):7.3f} {fla:7.3f} {fla / ours:8.2f} "
              f"{r['T'] / ours / 1e3:8.2f} {r.get('ours_gated_ms', nan):7.3f} "
              f"{r.get('ours_relerr_vs_ieee', nan):8.2e} {r.get('ours_v2_relerr_vs_ieee', nan):8.2e} "
              f"{r.get('fla_norm_relerr_vs_ieee', nan):8.2e}")


if __name__ == "__main__":
    raise SystemExit(main())
