"""KDA prefill v3's state chain emulated in float64 on the CPU, with the kernel's roundings applied where the
kernel applies them, to predict the precision of each ``chain_precision`` before it runs on a GPU.

The in-chunk quantities (``w``, ``qg``, ``kd``, ``u``, ``exp(gl)``, kda_prefill_intra64_b.py, and ``Aqk``,
kernels D and A) are computed exactly in float64 and rounded as the kernels store them: float32 (their tf32x3
products are about float32-accurate), then bf16 (round to nearest) for w, qg, kd and Aqk, with the lo half
``bf16(x - hi)`` where the chain reads it. The output is ``o = qg S + Aqk v'``: S's parts against qg's hi part,
and ``Aqk v'`` in the chain's precision (as ``kd^T v'`` below, Aqk in kd's place). The state pass (kda_prefill_state_pass.py) keeps S in float32; every tensor-core product takes its
bf16 operands exactly and is rounded to float32 once (accumulation inside one product is taken as exact),
added to its float32 accumulator in the order the kernel issues them:

- bf16x3: ``w S ~ w_hi S_hi + w_lo S_hi + w_hi S_lo``, ``kd^T v' ~ kd_hi^T v'_hi + kd_lo^T v'_hi + kd_hi^T v'_lo``
- bf16x2: ``w S ~ w_hi S_hi + w_hi S_lo``, ``kd^T v' ~ kd_hi^T v'_hi + kd_hi^T v'_lo``
- bf16: ``w_hi S_hi``, ``kd_hi^T v'_hi``
- fp16x2: bf16x2's products with every operand in fp16 instead (w and kd rounded to 11 significant bits, S and
  v' as fp16 hi + lo pairs): not a kernel option, the question whether fp16's finer rounding would let the
  two-product chain keep bf16x3's precision (it does not: 40-50x bf16x3's error, 0.7x plain tf32's)
- tf32: one product each with both operands rounded to tf32 (v2's ``chain_precision="tf32"``), the class the
  chain must stay out of
- fp32: float32 operands, for scale.

The reference is the same chunked algebra without any rounding, checked against ``kda_chunk_one_ref`` (run
in float64) at a shorter length. Inputs as bench/kda_precision.py: bf16 q, k, v, beta; slow decay (log-decay
``-0.05 sigmoid(x)``), gates near the -5 lower bound (``-5 sigmoid(x/2 + 6)``), the GPU chain test's gates
(``-0.02 sigmoid(x)``) and a longer memory (``-0.002 sigmoid(x)``, about 1000 tokens).

    python bench/kda_chain_emulation.py [--lengths 65536,16384] [--out DIR]
        -> bench/results/kda_chain_emulation.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, write_results  # noqa: E402

from flashinfra.kernels.kda.prefill import kda_chunk_one_ref, l2norm_ref  # noqa: E402

CHAINS = ("exact", "fp32", "bf16x3", "bf16x2", "bf16", "fp16x2", "tf32")
# log-decay -a sigmoid(b x + c): bench/kda_precision.py's two regimes, the GPU chain test's, and a longer memory
REGIMES = {"slow_decay": (0.05, 1.0, 0.0), "lower_bound": (5.0, 0.5, 6.0), "chain_test": (0.02, 1.0, 0.0),
           "long_memory": (0.002, 1.0, 0.0)}


def inputs(T: int, regime: str, H: int = 1, K: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + T + len(regime))
    q, k, v = (torch.randn(T, H, K, generator=gen).bfloat16().double() for _ in range(3))
    x = torch.randn(T, H, K, generator=gen)
    g = -REGIMES[regime][0] * torch.sigmoid(x * REGIMES[regime][1] + REGIMES[regime][2])
    beta = torch.rand(T, H, generator=gen).bfloat16()
    return q, k, v, g.double(), beta.double()


def in_chunk(q, k, v, g, beta):
    """One head ([T, D] inputs, T a multiple of 64): exact per-chunk w, qg, kd, u, exp(gl) ([N, 64, D]) and Aqk
    ([N, 64, 64])."""
    T, K = k.shape
    N = T // 64
    q = (l2norm_ref(q) * K**-0.5).view(N, 64, K)
    k = l2norm_ref(k).view(N, 64, K)
    v, beta = v.view(N, 64, -1), beta.view(N, 64, 1)
    gc = g.view(N, 64, K).cumsum(1)
    gl = gc[:, -1:, :]
    kp, km = k * gc.exp(), k * (-gc).exp()  # |gc| <= 320 here: no float64 overflow
    strict = torch.tril(torch.ones(64, 64, dtype=torch.bool), -1)
    L = (beta * kp @ km.transpose(1, 2)).masked_fill(~strict, 0.0)
    Aqk = (q * gc.exp() @ km.transpose(1, 2)).masked_fill(~(strict | torch.eye(64, dtype=torch.bool)), 0.0)
    I = torch.eye(64, dtype=torch.float64).expand(N, 64, 64)
    Ai = torch.linalg.solve_triangular(I + L, I, upper=False, unitriangular=True)
    w = Ai @ (beta * kp)
    u = Ai @ (beta * v)
    return dict(w=w, qg=q * gc.exp(), kd=k * (gl - gc).exp(), u=u, aqk=Aqk, egl=gl.exp()[:, 0, :])


def f32(x):
    return x.float().double()


def rounded(x, truncate: bool = False, dtype: str = "bf16"):
    """x (float32 values) rounded to bf16 (or ``dtype`` "fp16", or "tf32": 10 mantissa bits in float32's
    range): to nearest as on the GPU, or (bf16) by truncation as Triton's interpreter."""
    if dtype == "fp16":
        return x.half().double()
    if dtype == "tf32":
        bits = x.float().contiguous().view(torch.int32)
        return ((bits + 0x1000) & -8192).view(torch.float32).double()
    if truncate:
        return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).double()
    return x.bfloat16().double()


def pair(x, truncate: bool = False, dtype: str = "bf16"):
    hi = rounded(x, truncate, dtype)
    return hi, rounded(x - hi, truncate, dtype)


def state_pair(x, truncate: bool = False, dtype: str = "bf16", mode: str = "bf16x3"):
    """The state pass's own split of S and v' (kda_prefill_state_pass.py, ``_parts``): for the bf16x3 and bf16x2 chains
    bf16 hi by truncation and lo the rest to nearest; otherwise as the tiles' pairs (``pair``), both to nearest."""
    if dtype != "bf16" or mode == "bf16":
        return pair(x, truncate, dtype)
    hi = rounded(x, True)
    return hi, rounded(x - hi, truncate)


def chain(t: dict, mode: str, truncate: bool = False):
    """The state pass over all chunks of one head: (o [T, V], final S [K, V]), S starting at zero; ``truncate``
    rounds to bf16 as Triton's interpreter does (tests/kernels/interpret_kda.py compares the kernel there)."""
    N, _, K = t["w"].shape
    V = t["u"].shape[-1]
    S = torch.zeros(K, V, dtype=torch.float64)
    o = torch.empty(N, 64, V, dtype=torch.float64)
    if mode == "exact":
        for n in range(N):
            vn = t["u"][n] - t["w"][n] @ S
            o[n] = t["qg"][n] @ S + t["aqk"][n] @ vn
            S = t["egl"][n][:, None] * S + t["kd"][n].T @ vn
        return o.view(-1, V), S
    r = {name: f32(x) for name, x in t.items()}
    if mode == "fp32":
        for n in range(N):
            vn = f32(r["u"][n] - f32(r["w"][n] @ S))
            o[n] = f32(f32(r["qg"][n] @ S) + f32(r["aqk"][n] @ vn))
            S = f32(f32(r["egl"][n][:, None] * S) + f32(r["kd"][n].T @ vn))
        return o.view(-1, V), S
    if mode == "tf32":
        for n in range(N):
            s_t = rounded(S, dtype="tf32")
            vn = f32(r["u"][n] - f32(rounded(r["w"][n], dtype="tf32") @ s_t))
            o[n] = f32(f32(rounded(r["qg"][n], dtype="tf32") @ s_t)
                       + f32(rounded(r["aqk"][n], dtype="tf32") @ rounded(vn, dtype="tf32")))
            S = f32(f32(r["egl"][n][:, None] * S) + f32(rounded(r["kd"][n], dtype="tf32").T @ rounded(vn, dtype="tf32")))
        return o.view(-1, V), S
    dt = "fp16" if mode.startswith("fp16") else "bf16"
    (w_h, w_l), (q_h, _), (k_h, k_l) = (pair(r[n], truncate, dt) for n in ("w", "qg", "kd"))
    a_h, a_l = pair(r["aqk"], truncate, dt)
    x3, lo = mode == "bf16x3", mode in ("bf16x3", "bf16x2", "fp16x2")
    for n in range(N):
        s_h, s_l = state_pair(S, truncate, dt, mode)
        o[n] = f32(f32(q_h[n] @ s_h) + q_h[n] @ s_l)
        ws = f32(w_h[n] @ s_h)
        if x3:
            ws = f32(ws + w_l[n] @ s_h)
        if lo:
            ws = f32(ws + w_h[n] @ s_l)
        vn = f32(r["u"][n] - ws)
        v_h, v_l = state_pair(vn, truncate, dt, mode)
        o[n] = f32(o[n] + a_h[n] @ v_h)
        if x3:
            o[n] = f32(o[n] + a_l[n] @ v_h)
        if lo:
            o[n] = f32(o[n] + a_h[n] @ v_l)
        S = f32(f32(r["egl"][n][:, None] * S) + k_h[n].T @ v_h)
        if x3:
            S = f32(S + k_l[n].T @ v_h)
        if lo:
            S = f32(S + k_h[n].T @ v_l)
    return o.view(-1, V), S


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def check_reference(T: int = 2048) -> float:
    """The exact chunked chain against ``kda_chunk_one_ref`` run in float64 (``kda_prefill_ref`` would cast
    its inputs to float32): agreement to float64 rounding."""
    worst = 0.0
    for regime in ("slow_decay", "lower_bound"):
        q, k, v, g, beta = inputs(T, regime)
        o, S = chain(in_chunk(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]), "exact")
        ref, s64 = kda_chunk_one_ref(l2norm_ref(q), l2norm_ref(k), v, g, beta,
                                     torch.zeros(1, 128, 128, dtype=torch.float64))
        worst = max(worst, rel(o, ref[:, 0]), rel(S, s64[0]))
    if worst > 1e-10:
        raise AssertionError(f"the emulation's exact chain disagrees with kda_prefill_ref: {worst:.3g}")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="65536,16384")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--name", default="kda_chain_emulation")
    args = ap.parse_args()
    lengths = [int(t) for t in args.lengths.split(",")]
    if any(T % 64 or T < 64 for T in lengths):
        raise SystemExit("--lengths must be multiples of 64")
    res = header()
    res["reference_check_relerr"] = check_reference()
    res["rows"] = []
    for T, regime in [(T, r) for T in lengths for r in args.regimes.split(",")]:
        t0 = time.time()
        q, k, v, g, beta = inputs(T, regime)
        t = in_chunk(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
        o64, s64 = chain(t, "exact")
        row = {"T": T, "H": 1, "regime": regime, "g_mean": float(g.mean())}
        for mode in CHAINS[1:]:
            o, S = chain(t, mode)
            row[f"{mode}_state_relerr"] = rel(S, s64)
            row[f"{mode}_out_relerr"] = rel(o, o64)
            row[f"{mode}_out_relerr_tail4096"] = rel(o[-4096:], o64[-4096:])
        row["seconds"] = time.time() - t0
        res["rows"].append(row)
        print({n: (f"{x:.3g}" if isinstance(x, float) else x) for n, x in row.items()}, flush=True)
        write_results(args.name, res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
