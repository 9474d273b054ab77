"""Host and wall time of cuBLAS's first bf16 GEMMs at row counts not met before, against the same calls again, in a
fresh process: the slice's dense projection shapes at prompt-chunk row counts (8,192 and the ones a prompt's last
chunk has), and MLA's batched absorb product. Tells whether a step's first GEMMs at a new row count cost host time
(kernel selection, module loading) that a warm-up would have to cover.

    python3 bench/cublas_first_calls.py --out bench/results/cublas_first_calls.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flashinfra.feedback.timing import header, write_results

SHAPES = [(24896, 4096), (4096, 8192), (2048, 4096), (16384, 1536), (4096, 16384), (154880, 4096)]  # (N, K)
ROWS = (8192, 8191, 8188, 8160, 8000, 7777, 8160, 4096, 4000, 1000, 999)  # 8,160 twice: the second is not new


def _twice(run) -> dict:
    """(host ms, wall ms) of ``run`` the first time and again."""
    out = {}
    for attempt in ("first", "again"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        out[attempt] = dict(host_ms=round(host * 1e3, 2), wall_ms=round((time.perf_counter() - t) * 1e3, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cublas_first_calls.json")
    args = ap.parse_args()
    report = header()
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in SHAPES]
    rows = report["linear"] = []
    for m in ROWS:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES]
        rows.append(dict(rows=m, **_twice(lambda: [F.linear(x, w) for x, w in zip(xs, ws)])))
        print(rows[-1], flush=True)
    w = torch.randn(64, 512, 256, device="cuda", dtype=torch.bfloat16)  # MLA's [H, R, Dq] absorb weight
    bmm = report["absorb_bmm"] = []
    for m in (8192, 8160, 8000):
        q = torch.randn(64, m, 256, device="cuda", dtype=torch.bfloat16)
        bmm.append(dict(rows=m, **_twice(lambda: torch.matmul(q, w.transpose(1, 2)))))
        print(bmm[-1], flush=True)
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)


if __name__ == "__main__":
    main()
