"""Where flash-linear-attention's chunk_kda spends its time: every GPU kernel of one call, from the PyTorch
profiler, summed per kernel name and divided by the number of profiled calls; v3's total in the same run.

    python bench/kda_fla_parts.py [--cases T8192,varlen16,T65536] [--out DIR]

Same inputs as ``bench/kda_prefill.py`` (H=64, K=V=128, bf16 q/k/v, float32 g, FLA given k normalised and
beta in bf16, final state written). FLA's first call per shape autotunes (a minute or more), outside the
profile. Writes ``kda_fla_parts.json`` (into ``bench/results/`` and ``--out``).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from kda_common import fla_version, header, time_eager, write_results
from kda_prefill import VARLEN, inputs

from flashinfra.kernels.kda.prefill import kda_prefill_launch

K = V = 128
CALLS = 5
SHAPES = {"T8192": [8192], "varlen16": VARLEN, "T65536": [65536]}


def kernel_times(fn, calls: int = CALLS) -> dict[str, float]:
    """Microseconds per call of each GPU kernel ``fn`` launches (summed per name over ``calls`` calls)."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / calls
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def profile_case(label: str, lens: list[int]) -> dict:
    from fla.ops.kda import chunk_kda

    a = inputs(lens, seed=len(lens) + lens[0])
    T, N = sum(lens), len(lens)
    cu = torch.tensor(a["cu"], device="cuda", dtype=torch.int32)
    q4, v4 = a["q"].unsqueeze(0), a["v"].unsqueeze(0)
    kn = torch.nn.functional.normalize(a["k"].float(), dim=-1).bfloat16().unsqueeze(0)
    g4, b4 = a["g"].unsqueeze(0), a["beta"].bfloat16().unsqueeze(0)
    h0 = a["state"].clone()

    def fla():
        return chunk_kda(q4, kn, v4, g4, b4, scale=K**-0.5, initial_state=h0, output_final_state=True,
                         cu_seqlens=cu)

    slots, init = list(range(N)), [True] * N

    def ours():
        return kda_prefill_launch(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], slots, init)

    iters = 5 if T > 20000 else 10
    row = {"case": label, "T": T, "fla_kernels_us": kernel_times(fla), "ours_kernels_us": kernel_times(ours)}
    row["fla_kernel_sum_ms"] = sum(row["fla_kernels_us"].values()) / 1e3
    row["ours_kernel_sum_ms"] = sum(row["ours_kernels_us"].values()) / 1e3
    row["fla_ms"] = time_eager(fla, iters=iters, warmup=1) / 1e3
    row["ours_ms"] = time_eager(ours, iters=iters, warmup=1) / 1e3
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="T8192,varlen16,T65536")
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    res = header() | {"fla": fla_version(), "shape": {"H": 64, "K": K, "V": V}, "rows": []}
    for label in args.cases.split(","):
        row = profile_case(label, SHAPES[label])
        res["rows"].append(row)
        write_results("kda_fla_parts", res, args.out)
        print(f"{label}: FLA {row['fla_ms']:.3f} ms (kernels {row['fla_kernel_sum_ms']:.3f}), "
              f"ours {row['ours_ms']:.3f} ms (kernels {row['ours_kernel_sum_ms']:.3f})", flush=True)
        for who in ("fla", "ours"):
            for name, us in row[f"{who}_kernels_us"].items():
                print(f"  {who:4s} {us:9.1f} us  {name[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
