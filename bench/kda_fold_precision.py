"""Kernel B's ``b_fold`` (kda_prefill_intra64_b.py) against its chained products, in float64 on the CPU with the
tensor cores' tf32 operand rounding applied where the kernel applies it, to compare their precision before a
GPU runs them.

Per chunk-head (64 rows, K=V=128, L2-normalised q and k, the decay's cumulative sum ``gc``, beta in (0, 1)):

- chained (the default): ``w = tf32(Ai) tf32(X)``, ``qw = q exp(gc) - tf32(Aqk) tf32(w)``, and
  ``u = tf32(Ai) tf32(beta v)``, ``ou = tf32(Aqk) tf32(u)``;
- folded: ``M = Aqk Ai`` formed once at float32 accuracy (tf32x3), ``qw = q exp(gc) - tf32(M) tf32(X)`` and
  ``ou = tf32(M) tf32(beta v)``;

with ``X = beta k exp(gc)``, products accumulated exactly, against the same algebra unrounded. Prints each
form's relative error (mean and largest over the chunk-heads) of qw and ou per decay scale.

    python bench/kda_fold_precision.py [--heads 20]     -> bench/results/kda_fold_precision.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, write_results  # noqa: E402


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to nearest with 10 explicit mantissa bits (a tf32 operand)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2**11) / 2**11, e)


def chunk_head(gen: torch.Generator, K: int, decay: float) -> dict:
    """One chunk-head's float64 inputs and in-chunk matrices, as kernels D and A define them."""
    def rnd(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=gen)

    q, k, v = rnd(64, K), rnd(64, K), rnd(64, K)
    q = q / q.norm(dim=1, keepdim=True) * K**-0.5
    k = k / k.norm(dim=1, keepdim=True)
    gc = (-decay * torch.sigmoid(rnd(64, K))).cumsum(0)
    beta = torch.rand(64, dtype=torch.float64, generator=gen)
    e = torch.exp(gc[:, None, :] - gc[None, :, :])
    low = torch.ones(64, 64, dtype=torch.bool).tril()
    aqk = torch.where(low, torch.einsum("rd,cd,rcd->rc", q, k, e), 0.0)
    L = torch.where(low.tril(-1), torch.einsum("rd,cd,rcd->rc", k, k, e) * beta[:, None], 0.0)
    ai = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + L)
    return dict(qe=q * torch.exp(gc), X=k * beta[:, None] * torch.exp(gc), bv=v * beta[:, None], aqk=aqk, ai=ai)


def errors(c: dict) -> dict:
    """Relative errors of qw and ou, chained and folded."""
    qw = c["qe"] - c["aqk"] @ c["ai"] @ c["X"]
    ou = c["aqk"] @ c["ai"] @ c["bv"]
    m = (c["aqk"] @ c["ai"]).float().double()
    w = tf32(c["ai"]) @ tf32(c["X"])
    u = tf32(c["ai"]) @ tf32(c["bv"])
    forms = {"chained": (c["qe"] - tf32(c["aqk"]) @ tf32(w), tf32(c["aqk"]) @ tf32(u)),
             "fold": (c["qe"] - tf32(m) @ tf32(c["X"]), tf32(m) @ tf32(c["bv"]))}
    return {f"{name} {t}": float((x - ref).norm() / ref.norm())
            for name, (a, b) in forms.items() for t, x, ref in (("qw", a, qw), ("ou", b, ou))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=20, help="chunk-heads per decay scale")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    res = header() | {"heads": args.heads, "K": 128, "note": "relative error, mean / largest over the chunk-heads",
                      "rows": []}
    for decay in (0.1, 1.0, 5.0):
        rows = [errors(chunk_head(gen, 128, decay)) for _ in range(args.heads)]
        stats = {key: (sum(r[key] for r in rows) / len(rows), max(r[key] for r in rows)) for key in rows[0]}
        res["rows"].append({"decay": decay} | {key: {"mean": a, "max": b} for key, (a, b) in stats.items()})
        print(f"decay {decay}: " + ", ".join(f"{key} {a:.2e} / {b:.2e}" for key, (a, b) in stats.items()))
    write_results("kda_fold_precision", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
