"""KDA precision on the GPU against float64: chunked prefill at long T and the layer decode's state over many steps.

1. Prefill, H=2, K=V=128, T=65536 and 131072, against the float64 reference (``kda_chunk_one_ref`` in float64, the
   chunked form of the recurrence, exact up to float64 rounding), with slow-decay gates (log-decay about -0.025 per
   token: long memory) and gates at the -5 lower bound (fast decay): ``ours`` (bf16 q/k/v, the shipped path, bf16
   output), ``ours_fp32q`` (float32 q: the float32-activation path, float32 output, which shows the kernels' own
   error below bf16 rounding) and FLA's ``chunk_kda`` with the norm in its kernel. Reported: relative error of all
   outputs, of the last 4096, and of the final state.
2. Decode, ``--decode-steps`` steps of the fused layer decode (B=8, H=64) with fp32 and with bf16 state, against
   the same steps in float64, with typical gates and with slow-decay gates: output error over the last 256 steps and
   the final state's error.

    python bench/kda_precision.py [--lengths 65536,131072] [--decode-steps 4096] [--no-fla] [--name kda_precision]
                                  [--out DIR]   -> bench/results/<name>.json

Needs ``fla-core`` for the FLA entries (without it the rows carry ``fla_error``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashinfra.feedback.timing import header, write_results  # noqa: E402
from flashinfra.kernels.kda.decode import kda_layer_decode_launch  # noqa: E402
from flashinfra.kernels.kda.prefill import kda_prefill_launch  # noqa: E402

try:  # the pure-PyTorch references: flashinfra.kernels.kda.ref where it exists, else beside the launchers
    from flashinfra.kernels.kda.ref import kda_chunk_one_ref, kda_layer_decode_ref, l2norm_ref
except ImportError:
    from flashinfra.kernels.kda.decode import kda_layer_decode_ref
    from flashinfra.kernels.kda.prefill import kda_chunk_one_ref, l2norm_ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def prefill_case(T: int, regime: str, with_fla: bool, H: int = 2, K: int = 128) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(T + len(regime))
    q = torch.randn(T, H, K, device="cuda", generator=gen).bfloat16()
    k = torch.randn(T, H, K, device="cuda", generator=gen).bfloat16()
    v = torch.randn(T, H, K, device="cuda", generator=gen).bfloat16()
    x = torch.randn(T, H, K, device="cuda", generator=gen)
    g = (-0.05 * torch.sigmoid(x)) if regime == "slow_decay" else (-5.0 * torch.sigmoid(x * 0.5 + 6.0))
    beta = torch.rand(T, H, device="cuda", generator=gen).bfloat16().float()
    cu, slots, init = [0, T], [0], [False]
    row = {"T": T, "H": H, "regime": regime, "g_mean": float(g.mean())}
    t0 = time.time()
    # kda_chunk_one_ref in float64 throughout, one head at a time (kda_prefill_ref casts to float32)
    ref, s64 = torch.empty(T, H, K, dtype=torch.float64, device="cuda"), torch.empty(1, H, K, K, dtype=torch.float64,
                                                                                       device="cuda")
    for h in range(H):
        x = [t[:, h : h + 1].double() for t in (q, k, v, g, beta)]
        ref[:, h : h + 1], s64[:, h] = kda_chunk_one_ref(l2norm_ref(x[0]), l2norm_ref(x[1]), *x[2:],
                                                         torch.zeros(1, K, K, dtype=torch.float64, device="cuda"))
    row["ref_seconds"] = time.time() - t0
    tail = slice(T - 4096, T)

    def record(name, o, s):
        row[f"{name}_relerr"] = rel(o, ref)
        row[f"{name}_relerr_tail4096"] = rel(o[tail], ref[tail])
        row[f"{name}_state_relerr"] = rel(s, s64)

    for name, q_in in (("ours", q), ("ours_fp32q", q.float())):
        s = torch.full((1, H, K, K), float("nan"), device="cuda")  # an unwritten element shows as a NaN error
        o = kda_prefill_launch(q_in, k, v, g, beta, s, cu, slots, init)
        record(name, o, s)
    try:
        if not with_fla:
            raise ImportError("FLA left out of this run (--no-fla)")
        from fla.ops.kda import chunk_kda

        o, s = chunk_kda(q[None], k[None], v[None], g[None], beta.bfloat16()[None], scale=K**-0.5,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        record("fla", o[0], s)
    except ImportError as exc:
        row["fla_error"] = repr(exc)
    del ref, s64
    torch.cuda.empty_cache()
    return row


def decode_case(regime: str, steps: int = 4096, B: int = 8, H: int = 64, K: int = 128, W: int = 4) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(7 + len(regime))
    C = 3 * H * K
    conv_weight = torch.randn(C, W, device="cuda", generator=gen) * 0.5
    A_log = torch.randn(H, device="cuda", generator=gen) * 0.3
    dt_bias = torch.randn(H * K, device="cuda", generator=gen) + (-6.0 if regime == "slow_decay" else 0.0)
    norm_weight = torch.randn(K, device="cuda", generator=gen).bfloat16()
    slots = torch.arange(B, device="cuda")
    fixed = dict(conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, norm_weight=norm_weight,
                 eps=1e-5, state_slots=slots)
    fixed64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
               for n, t in fixed.items()}
    launches = ("fp32", "bf16")
    states = {n: torch.zeros(B, H, K, K, device="cuda", dtype=torch.float32 if n == "fp32" else torch.bfloat16)
              for n in launches}
    convs = {n: torch.zeros(B, C, W - 1, device="cuda", dtype=torch.bfloat16) for n in states}
    s64, c64 = torch.zeros(B, H, K, K, device="cuda", dtype=torch.float64), torch.zeros(B, C, W - 1, device="cuda",
                                                                                        dtype=torch.float64)
    err = {n: [0.0, 0.0] for n in states}  # squared error and squared norm over the last 256 steps
    for step in range(steps):
        step_in = dict(qkv=torch.randn(B, C, device="cuda", generator=gen).bfloat16(),
                       g_raw=torch.randn(B, H * K, device="cuda", generator=gen).bfloat16(),
                       beta_logits=torch.randn(B, H, device="cuda", generator=gen).bfloat16(),
                       gate=torch.randn(B, H * K, device="cuda", generator=gen).bfloat16())
        ref = kda_layer_decode_ref(**{n: t.double() for n, t in step_in.items()}, **fixed64, conv_state=c64,
                                   state=s64)
        for n in states:
            out = kda_layer_decode_launch(**step_in, **fixed, conv_state=convs[n], state=states[n])
            if step >= steps - 256:
                err[n][0] += float((out.double() - ref).pow(2).sum())
                err[n][1] += float(ref.pow(2).sum())
    row = {"regime": regime, "steps": steps, "B": B, "H": H}
    for n in states:
        row[f"{n}_state_relerr"] = rel(states[n], s64)
        row[f"{n}_out_relerr_last256"] = (err[n][0] / err[n][1]) ** 0.5
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--lengths", default="65536,131072")
    ap.add_argument("--decode-steps", type=int, default=4096, help="0 leaves the decode part out")
    ap.add_argument("--name", default="kda_precision", help="result file name in bench/results/")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--no-fla", action="store_true", help="leave FLA out (its autotuning takes minutes)")
    args = ap.parse_args()
    res = header() | {"prefill": [], "decode": []}
    for T in [int(t) for t in args.lengths.split(",")]:
        for regime in ("slow_decay", "lower_bound"):
            try:
                row = prefill_case(T, regime, not args.no_fla)
            except torch.cuda.OutOfMemoryError as exc:
                row = {"T": T, "regime": regime, "error": repr(exc)[:300]}
                torch.cuda.empty_cache()
            res["prefill"].append(row)
            print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            write_results(args.name, res, args.out)  # after each row, so that a cut-off run keeps what it measured
    for regime in ("typical", "slow_decay") if args.decode_steps else ():
        row = decode_case(regime, steps=args.decode_steps, B=args.decode_batch)
        res["decode"].append(row)
        print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    write_results(args.name, res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
