"""KDA chunked prefill on the GPU against flash-linear-attention's chunk_kda, H=64, K=V=128, bf16 q/k/v:
T=8192, a packed batch of 16 sequences of mixed lengths (18558 tokens) and T=65536 (the anchors' shapes), in one run.

Per case, on the same inputs:
- ``ours``: ``kda_prefill_launch`` (fp32 g and beta given, q/k L2 norm fused, final state written in place), the
  whole call timed as FLA's is (argument checks, index tensors and scratch included), ``--samples`` times
  interleaved with FLA's; its kernels' device time one by one (torch.profiler, kernel names), and the host time
  until the call returns (the launches queued);
- ``ours_gated``: ``kda_prefill_gated_launch`` (raw gate, lower bound, beta logits), as the model calls it;
- ``fla``: ``chunk_kda`` as the anchors ran it (k normalised outside, g and beta given, final state written); with
  ``--fla-fused`` also with the gate, beta sigmoid and norms in its kernel;
- precision on the first ``--ref-heads`` heads against the float64 chunked reference: ours and FLA with the norm in
  its kernel (``use_qk_l2norm_in_kernel``), output and final state;
- floors: the bytes read and written once at the copy bandwidth measured in the same run.

    python bench/kda_prefill.py [--cases T8192,varlen16,T65536] [--samples 2] [--iters 20] [--no-fla]
                                [--fla-fused] [--name kda_prefill] [--out DIR]   -> bench/results/<name>.json

FLA autotunes on its first call per shape (a minute or more), outside the timing. Needs ``fla-core`` for the FLA
rows (without it they carry ``fla_error``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from flashinfra.feedback.timing import (  # noqa: E402
    copy_bandwidth_GBps,
    header,
    kernel_times_us,
    relerr,
    time_eager,
    write_results,
)
from flashinfra.kernels.kda.prefill import kda_prefill_gated_launch, kda_prefill_launch  # noqa: E402

try:  # the pure-PyTorch references: flashinfra.kernels.kda.ref where it exists, else beside the launchers
    from flashinfra.kernels.kda.ref import kda_chunk_one_ref, l2norm_ref
except ImportError:
    from flashinfra.kernels.kda.prefill import kda_chunk_one_ref, l2norm_ref

H, K, V, LB = 64, 128, 128, -5.0
VARLEN = [4096, 3000, 2500, 2048, 1500, 1200, 1000, 900, 700, 512, 400, 300, 200, 100, 64, 38]
SHAPES = {"T8192": [8192], "varlen16": VARLEN, "T65536": [65536]}
ANCHORS_MTOK_S = {"T8192": 4.09, "T65536": 4.43, "varlen16": 4.35}  # FLA's chunk_kda, the stored anchors


def inputs(lens: list[int], seed: int, device: str = "cuda", state_dtype=torch.float32) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    a = dict(q=rnd(T, H, K), k=rnd(T, H, K), v=rnd(T, H, V), g_raw=rnd(T, H, K), beta_logits=rnd(T, H),
             A_log=rnd(H, dtype=torch.float32) * 0.3, dt_bias=rnd(H * K, dtype=torch.float32))
    a["g"] = (LB * torch.sigmoid(torch.randn(T, H, K, device=device, generator=gen))).float()
    a["beta"] = torch.rand(T, H, device=device, generator=gen).bfloat16().float()  # exact for FLA's bf16 beta
    a["cu"] = [0] + list(itertools.accumulate(lens))
    a["state"] = (torch.randn(len(lens), H, K, V, device=device, generator=gen) * 0.1).to(state_dtype)
    return a


def bytes_floor(T: int, N: int) -> int:
    """q, k, v, o in bf16, g in fp32, beta, each once; the states read and written once (fp32)."""
    return T * H * (2 * K * 2 + V * 2 + K * 4 + 4 + V * 2) + 2 * N * H * K * V * 4


def reference(a: dict, s0: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [T, heads, V] and final states [N, heads, K, V] of the first ``heads`` heads, float64."""
    cu = a["cu"]
    o = torch.empty(cu[-1], heads, V, dtype=torch.float64, device=a["q"].device)
    s = torch.empty(len(cu) - 1, heads, K, V, dtype=torch.float64, device=a["q"].device)
    for b in range(len(cu) - 1):
        for h in range(heads):
            x = [t[cu[b]:cu[b + 1], h:h + 1].double() for t in (a["q"], a["k"], a["v"], a["g"], a["beta"])]
            o[cu[b]:cu[b + 1], h:h + 1], s[b, h:h + 1] = kda_chunk_one_ref(
                l2norm_ref(x[0]), l2norm_ref(x[1]), *x[2:], s0[b, h:h + 1].double())
    return o, s


def fla_calls(a: dict, s0: torch.Tensor, fused: bool) -> dict:
    from fla.ops.kda import chunk_kda

    cu = torch.tensor(a["cu"], device="cuda", dtype=torch.int32)
    q4, k4, v4 = (a[n].unsqueeze(0) for n in ("q", "k", "v"))
    kn = torch.nn.functional.normalize(a["k"].float(), dim=-1).bfloat16().unsqueeze(0)
    g4, b4 = a["g"].unsqueeze(0), a["beta"].bfloat16().unsqueeze(0)
    h0 = s0.clone()
    calls = {
        "fla": lambda: chunk_kda(q4, kn, v4, g4, b4, scale=K**-0.5, initial_state=h0, output_final_state=True,
                                 cu_seqlens=cu),
        "fla_norm": lambda: chunk_kda(q4, k4, v4, g4, b4, scale=K**-0.5, initial_state=s0.clone(),
                                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu),
    }
    if fused:
        calls["fla_fused"] = lambda: chunk_kda(
            q4, k4, v4, a["g_raw"].unsqueeze(0), a["beta_logits"].unsqueeze(0), scale=K**-0.5, initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB, A_log=a["A_log"], dt_bias=a["dt_bias"],
            cu_seqlens=cu)
    return calls


def host_us(fn, iters: int) -> float:
    """Median microseconds from a call's start until it returns to Python (its launches queued), from idle."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def run_case(label: str, args, res: dict) -> dict:
    lens = SHAPES[label]
    a = inputs(lens, seed=len(lens) + lens[0], state_dtype=getattr(torch, args.state_dtype))
    T, N = sum(lens), len(lens)
    slots, init = list(range(N)), [True] * N
    iters = args.iters or (5 if T > 20000 else 10)
    s0 = a["state"].to(torch.float32, copy=True)  # FLA's and the reference's initial state
    row = {"case": label, "T": T, "num_seqs": N, "iters": iters, "state_dtype": args.state_dtype}

    def ours():
        return kda_prefill_launch(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], slots, init)

    def ours_gated():
        return kda_prefill_gated_launch(a["q"], a["k"], a["v"], a["g_raw"], a["beta_logits"], a["A_log"],
                                        a["dt_bias"], LB, a["state"], a["cu"], slots, init)

    timed = {"ours": ours, "ours_gated": ours_gated}
    fla = {}
    try:
        if args.no_fla:
            raise ImportError("FLA left out of this run (--no-fla)")
        fla = fla_calls(a, s0, args.fla_fused)
    except ImportError as exc:
        row["fla_error"] = repr(exc)
    # precision first (each from the same initial state), then compile / autotune outside the timing
    if args.ref_heads:
        ref_o, ref_s = reference(a, s0, args.ref_heads)
        a["state"].copy_(s0)
        o = ours()
        row["ours_relerr_o_vs_fp64"] = relerr(o[:, :args.ref_heads], ref_o)
        row["ours_relerr_state_vs_fp64"] = relerr(a["state"][:, :args.ref_heads], ref_s)
        if "fla_norm" in fla:
            o, s = fla.pop("fla_norm")()
            row["fla_norm_relerr_o_vs_fp64"] = relerr(o[0, :, :args.ref_heads], ref_o)
            row["fla_norm_relerr_state_vs_fp64"] = relerr(s[:, :args.ref_heads], ref_s)
        del ref_o, ref_s
    fla.pop("fla_norm", None)
    timed |= fla
    for name, fn in timed.items():
        t0 = time.time()
        a["state"].copy_(s0)
        try:
            fn()
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.time() - t0
        except Exception as exc:  # one failing call must not hide the others' numbers
            row[f"{name}_error"] = repr(exc)[:300]
    timed = {n: fn for n, fn in timed.items() if f"{n}_error" not in row}
    samples: dict[str, list[float]] = {n: [] for n in timed}
    for _ in range(args.samples):  # ours and FLA interleaved, so that a drifting machine shows in both
        for name, fn in timed.items():
            samples[name].append(time_eager(fn, iters=iters, warmup=1) / 1e3)
    for name, ms in samples.items():
        row[f"{name}_ms_samples"] = ms
        row[f"{name}_ms"] = sorted(ms)[len(ms) // 2]
        row[f"{name}_Mtok_s"] = T / row[f"{name}_ms"] / 1e3
    if "ours_ms" in row:
        row["ours_host_us"] = host_us(ours, iters)
        row["ours_kernels_us"] = kernel_times_us(ours, calls=5)
        row["ours_device_ms"] = sum(row["ours_kernels_us"].values()) / 1e3
        row["speedup_vs_anchor"] = row["ours_Mtok_s"] / ANCHORS_MTOK_S[label]
        row["bytes"] = bytes_floor(T, N)
        row["floor_bytes_ms"] = row["bytes"] / res["copy_GBps"] / 1e6
        row["frac_bytes_floor"] = row["floor_bytes_ms"] / row["ours_ms"]
        row["flops_state_products"] = 3 * 2 * T * H * K * V
    if "ours_ms" in row and "fla_ms" in row:
        row["speedup_vs_fla"] = row["fla_ms"] / row["ours_ms"]
        row["speedup_vs_fla_samples"] = [f / o for f, o in zip(samples["fla"], samples["ours"])]
    if "ours_gated_ms" in row and "fla_fused_ms" in row:
        row["speedup_gated_vs_fla_fused"] = row["fla_fused_ms"] / row["ours_gated_ms"]
    return row


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"{'case':9s} {'ours ms':>8s} {'device':>7s} {'host us':>7s} {'FLA ms':>7s} {'FLA/ours':>8s} {'M tok/s':>8s} "
          f"{'/anchor':>7s} {'gated':>7s} {'floor':>6s} {'err o':>8s} {'err S':>8s} {'FLA o':>8s} {'FLA S':>8s}")
    for r in rows:
        print(f"{r['case']:9s} {r.get('ours_ms', nan):8.3f} {r.get('ours_device_ms', nan):7.3f} "
              f"{r.get('ours_host_us', nan):7.1f} {r.get('fla_ms', nan):7.3f} {r.get('speedup_vs_fla', nan):8.2f} "
              f"{r.get('ours_Mtok_s', nan):8.2f} {r.get('speedup_vs_anchor', nan):7.2f} "
              f"{r.get('ours_gated_ms', nan):7.3f} {r.get('frac_bytes_floor', nan):6.2f} "
              f"{r.get('ours_relerr_o_vs_fp64', nan):8.2e} {r.get('ours_relerr_state_vs_fp64', nan):8.2e} "
              f"{r.get('fla_norm_relerr_o_vs_fp64', nan):8.2e} {r.get('fla_norm_relerr_state_vs_fp64', nan):8.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="T8192,varlen16,T65536", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--samples", type=int, default=2, help="medians per call, ours and FLA interleaved")
    ap.add_argument("--iters", type=int, help="timed calls per median (10, or 5 past 20k tokens)")
    ap.add_argument("--ref-heads", type=int, default=2, help="heads checked against float64 (0: none)")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA out (its autotuning takes minutes)")
    ap.add_argument("--fla-fused", action="store_true", help="also FLA with the gate and beta in its kernel")
    ap.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="our kernels' state slots (--kda-state-dtype); FLA keeps float32 states")
    ap.add_argument("--name", default="kda_prefill", help="result file name in bench/results/")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in SHAPES]
    if unknown:
        ap.error(f"unknown cases {unknown}")
    res = header() | {"shape": dict(H=H, K=K, V=V), "anchors_Mtok_s": ANCHORS_MTOK_S, "rows": []}
    res["copy_GBps"] = copy_bandwidth_GBps()
    for label in cases:
        res["rows"].append(run_case(label, args, res))
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in res["rows"][-1].items()
               if not isinstance(v, (dict, list))}, flush=True)
        write_results(args.name, res, args.out)  # after each case, so that a cut-off run keeps what it measured
    print_table(res["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
