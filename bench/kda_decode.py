"""KDA decode on the GPU: our fused whole-layer decode (conv update, gate, beta, q/k L2 norm, recurrence and gated
RMSNorm of one layer; fp32 and bf16 recurrent state) against flash-linear-attention's fused_recurrent_kda (bare, the
goals' anchor, and with the conv update and gated RMSNorm it needs around it), H=64, K=V=128, conv width 4, at
B=1, 16, 64, 256, eager and in a CUDA graph, all in one run.

Per batch size: each call's median time eager and as one call replayed in a CUDA graph; the layer's bytes (state
read and written once, conv slot, inputs and output once) as GB/s and as a share of the copy bandwidth measured in
the same run (the floor); our layer against FLA's bare recurrence and FLA's layer (ratios); each of our layer's
kernels' device time (torch.profiler, eager); the output's relative error against the same step in float64.

    python bench/kda_decode.py [--batches 1,16,64,256] [--name kda_decode] [--out DIR]
        -> bench/results/<name>.json, a table last

Needs ``fla-core`` for the FLA rows (without it they carry ``fla_error``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from flashinfra.feedback.timing import (  # noqa: E402
    copy_bandwidth_GBps,
    header,
    kernel_times_us,
    relerr,
    time_eager,
    time_graph,
    write_results,
)
from flashinfra.kernels.kda.decode import kda_layer_decode_launch  # noqa: E402

try:  # the pure-PyTorch reference: flashinfra.kernels.kda.ref where it exists, else beside the launcher
    from flashinfra.kernels.kda.ref import kda_layer_decode_ref
except ImportError:
    from flashinfra.kernels.kda.decode import kda_layer_decode_ref

H, K, V, W, LB, EPS = 64, 128, 128, 4, -5.0, 1e-5
C = 3 * H * K


def layer_inputs(B: int, state_dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    return dict(
        qkv=rnd(B, C), conv_weight=rnd(C, W, dtype=torch.float32, scale=0.5), conv_state=rnd(B, C, W - 1),
        g_raw=rnd(B, H * K), beta_logits=rnd(B, H), gate=rnd(B, H * V), A_log=rnd(H, dtype=torch.float32, scale=0.3),
        dt_bias=rnd(H * K, dtype=torch.float32), lower_bound=LB, norm_weight=rnd(V), eps=EPS,
        state=rnd(B, H, K, V, dtype=state_dtype, scale=0.1),
        state_slots=torch.randperm(B, device="cuda", generator=gen),
    )


def layer_bytes(B: int, state_bytes: int) -> int:
    state = B * H * K * V * state_bytes * 2
    conv = B * C * (W - 1) * 2 * 2
    io = B * (C + H * K + H + H * V) * 2 + B * H * V * 2
    return state + conv + io


def layer_reference(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer step on ``a`` in float64 (the unfused reference): its output and the new recurrent states."""
    r = {k: (v.double().clone() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in a.items()}
    return kda_layer_decode_ref(**r), r["state"]


def check_layer(B: int, state_dtype: torch.dtype) -> float:
    """Relative error of the fused kernel's output against the unfused reference computed in float64 on the same
    inputs (the reference first: the launch updates the states in place)."""
    a = layer_inputs(B, state_dtype, seed=123)
    ref = layer_reference(a)[0]
    return relerr(kda_layer_decode_launch(**a), ref)


def fla_calls(B: int, a: dict) -> dict:
    """FLA's bare fp32 recurrence (g and beta given) and its layer (conv update, fused recurrence with gate, beta
    and norms in its kernel, gated RMSNorm) on the inputs of ``a`` (fp32 state)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import fused_recurrent_kda

    gen = torch.Generator(device="cuda").manual_seed(B + 2)
    q, k, v = (t.view(B, 1, H, -1).contiguous() for t in a["qkv"].split([H * K, H * K, H * V], dim=1))
    g = (LB * torch.sigmoid(torch.randn(B, 1, H, K, device="cuda", generator=gen))).float()
    beta = torch.rand(B, 1, H, device="cuda", generator=gen).bfloat16()
    h0 = a["state"].clone()
    cache = torch.randn(B, C, W, device="cuda", dtype=torch.bfloat16, generator=gen)

    def layer():
        y, _ = causal_conv1d_update(a["qkv"], cache, weight=a["conv_weight"], activation="silu")
        qq, kk, vv = (t.view(B, 1, H, -1) for t in y.split([H * K, H * K, H * V], dim=1))
        o, _ = fused_recurrent_kda(
            qq, kk, vv, a["g_raw"].view(B, 1, H, K), a["beta_logits"].view(B, 1, H), A_log=a["A_log"],
            dt_bias=a["dt_bias"], scale=K**-0.5, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LB)
        return rms_norm_gated(o.view(B * H, V), a["gate"].view(B * H, V), a["norm_weight"], None,
                              activation="sigmoid", eps=EPS)

    return {"fla_recurrence_fp32": lambda: fused_recurrent_kda(q, k, v, g, beta, scale=K**-0.5, initial_state=h0,
                                                               output_final_state=True),
            "fla_layer_fp32": layer}


def run_batch(B: int, copy_GBps: float) -> dict:
    row = {"B": B}
    fp32 = layer_inputs(B, torch.float32, seed=B)
    bf16 = layer_inputs(B, torch.bfloat16, seed=B + 1)
    cases = {"ours_layer_fp32": lambda: kda_layer_decode_launch(**fp32),
             "ours_layer_bf16": lambda: kda_layer_decode_launch(**bf16)}
    row["bytes_layer_fp32"] = layer_bytes(B, 4)
    row["bytes_layer_bf16"] = layer_bytes(B, 2)
    row["bytes_recurrence_fp32"] = B * H * K * V * 4 * 2
    try:
        cases |= fla_calls(B, fp32)
    except ImportError as exc:
        row["fla_error"] = repr(exc)
    for name, fn in cases.items():
        try:
            row[f"{name}_eager_us"] = time_eager(fn)
            row[f"{name}_graph_us"] = time_graph(fn)
        except Exception as exc:  # one failing case must not hide the others' numbers
            row[f"{name}_error"] = repr(exc)[:300]
    for dt in ("fp32", "bf16"):
        row[f"ours_layer_{dt}_kernels_us"] = kernel_times_us(cases[f"ours_layer_{dt}"])
    for name, key in (("ours_layer_fp32", "bytes_layer_fp32"), ("ours_layer_bf16", "bytes_layer_bf16"),
                      ("fla_recurrence_fp32", "bytes_recurrence_fp32"), ("fla_layer_fp32", "bytes_layer_fp32")):
        if f"{name}_graph_us" in row:
            row[f"{name}_graph_GBps"] = row[key] / row[f"{name}_graph_us"] / 1e3
            row[f"{name}_graph_frac_copy"] = row[f"{name}_graph_GBps"] / copy_GBps
    for fla in ("fla_recurrence_fp32", "fla_layer_fp32"):
        if f"{fla}_graph_us" in row and "ours_layer_fp32_graph_us" in row:
            row[f"ours_layer_fp32_vs_{fla}"] = row["ours_layer_fp32_graph_us"] / row[f"{fla}_graph_us"]
    row["relerr_layer_fp32_vs_fp64"] = check_layer(min(B, 16), torch.float32)
    row["relerr_layer_bf16_vs_fp64"] = check_layer(min(B, 16), torch.bfloat16)
    return row


def summary(rows: list[dict]) -> None:
    nan = float("nan")
    print(f"{'B':>4} {'fp32 us':>8} {'% copy':>7} {'bf16 us':>8} {'FLA rec':>8} {'/FLA rec':>8} {'FLA layer':>9} "
          f"{'eager fp32':>10}  (graph of one call)")
    for r in rows:
        print(f"{r['B']:>4} {r.get('ours_layer_fp32_graph_us', nan):8.2f} "
              f"{100 * r.get('ours_layer_fp32_graph_frac_copy', nan):7.1f} "
              f"{r.get('ours_layer_bf16_graph_us', nan):8.2f} "
              f"{r.get('fla_recurrence_fp32_graph_us', nan):8.2f} "
              f"{r.get('ours_layer_fp32_vs_fla_recurrence_fp32', nan):8.3f} "
              f"{r.get('fla_layer_fp32_graph_us', nan):9.2f} "
              f"{r.get('ours_layer_fp32_eager_us', nan):10.1f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--name", default="kda_decode", help="result file name in bench/results/")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    res = header() | {"shape": dict(H=H, K=K, V=V, W=W), "rows": []}
    res["copy_GBps"] = copy_bandwidth_GBps()
    print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
    for B in [int(b) for b in args.batches.split(",")]:
        res["rows"].append(run_batch(B, res["copy_GBps"]))
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in res["rows"][-1].items()
               if not isinstance(v, dict)}, flush=True)
        write_results(args.name, res, args.out)  # after each batch size, so a cut-short run keeps its rows
    summary(res["rows"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
