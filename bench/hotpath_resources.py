"""Registers, spills and shared memory of the hot-path kernels compiled for sm_90, without a GPU.

Triton compiles each kernel for an H200 (compute capability 9.0) on this machine, at the block shapes its
launcher picks for GLM-5.3-Flash sizes (bf16), and ``cuobjdump -res-usage`` (shipped with Triton) reads
the cubin: registers per thread, stack bytes (register spills land there), shared memory. A kernel that
spills, or sits at 255 registers, is the first suspect when its timing misses its floor.

usage: python bench/hotpath_resources.py [--out bench/results/hotpath_resources.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashinfra.kernels import dsa_indexer, fused_moe, mhc, moe_route, norms, sparse_mla

BF, F32, I32, I64 = "*bf16", "*fp32", "*i32", "*i64"
MOE1 = dict(x=BF, w=BF, h=BF, sorted_ids=I32, expert_ids=I32, used=I64, stride_x="i32", stride_we="i32",
            shared_off="i64", num_pairs="i32", limit="fp32")
MOE2 = dict(h=BF, w=BF, out=BF, topk_w=F32, sorted_ids=I32, expert_ids=I32, used=I64, stride_we="i32",
            shared_off="i64", num_pairs="i32")
HC_PRE = dict(x=BF, part=F32, sumsq=F32, base=F32, scale=F32, y=BF, post=F32, comb=F32, T="i32", D="i32",
              SPLIT="i32", iters="i32", eps="fp32", norm_eps="fp32")
MLA = dict(q=BF, latent=BF, sel=I32, token_seq=I32, block_tables=I32, o=BF, part_acc=F32, part_ml=F32,
           stride_qt="i32", stride_qh="i32", S="i32", W="i32", H="i32", CH="i32", scale="fp32")

# (label, kernel, argument types, constexprs, num_warps, num_stages): the launchers' choices at real sizes
CASES = [
    ("rms_norm D=4096", norms.rms_norm_kernel, dict(x=BF, w=BF, y=BF, stride_x="i32", stride_y="i32", N="i32",
                                                    D="i32", eps="fp32"), dict(BT=1, BD=4096), 8, 3),
    ("gated_rms_norm K=128", norms.gated_rms_norm_kernel, dict(x=BF, g=BF, w=BF, y=BF, stride_x="i32",
                                                               stride_g="i32", N="i32", D="i32", eps="fp32"),
     dict(BT=16, BD=128), 4, 3),
    ("hc_mix", mhc.hc_mix_kernel, dict(x=BF, fn=BF, part=F32, sumsq=F32, T="i32", K="i32", KS="i32"),
     dict(NM=24, BT=16, BN=32, BK=128, IEEE=False), 4, 3),
    ("hc_pre T=1", mhc.hc_pre_kernel, HC_PRE, dict(N=4, BN=32, BT=1, BD=1024), 4, 3),
    ("hc_pre T>=4", mhc.hc_pre_kernel, HC_PRE, dict(N=4, BN=32, BT=4, BD=256), 4, 3),
    ("hc_post T>=4", mhc.hc_post_kernel, dict(x=BF, out=BF, post=F32, comb=F32, y=BF, T="i32", D="i32"),
     dict(N=4, BT=4, BD=256), 4, 3),
    ("route E=288", moe_route.route_kernel, dict(logits=F32, bias=F32, w_out=F32, id_out=I32, T="i32", E="i32",
                                                 scaling="fp32"),
     dict(TOPK=8, G=1, TOPK_GROUP=1, NORM=True, BT=8, BE=512), 4, 3),
    ("moe_gemm1 decode", fused_moe.moe_gemm1_kernel, MOE1,
     dict(E=288, N=2048, K=4096, TOPK=9, IEEE=False, BM=16, BN=64, BK=128), 4, 4),
    ("moe_gemm2 decode", fused_moe.moe_gemm2_kernel, MOE2,
     dict(E=288, N=4096, K=2048, IEEE=False, BM=16, BN=64, BK=128), 4, 4),
    ("moe_gemm1 mid", fused_moe.moe_gemm1_kernel, MOE1,
     dict(E=288, N=2048, K=4096, TOPK=9, IEEE=False, BM=32, BN=64, BK=64), 8, 4),
    ("moe_gemm2 mid", fused_moe.moe_gemm2_kernel, MOE2, dict(E=288, N=4096, K=2048, IEEE=False, BM=32, BN=64, BK=64),
     8, 4),
    ("moe_gemm1 prefill", fused_moe.moe_gemm1_kernel, MOE1,
     dict(E=288, N=2048, K=4096, TOPK=9, IEEE=False, BM=64, BN=64, BK=64), 8, 3),
    ("moe_gemm2 prefill", fused_moe.moe_gemm2_kernel, MOE2,
     dict(E=288, N=4096, K=2048, IEEE=False, BM=64, BN=128, BK=64), 8, 3),
    ("moe_sum", fused_moe.moe_sum_kernel, dict(routed=BF, y=BF, D="i32"), dict(TOPK=9, BD=1024), 4, 3),
    ("pool_keys", dsa_indexer.pool_keys_kernel, dict(cache=BF, block_tables=I32, seq_lens=I32, ape=BF, out=BF,
                                                     W="i32", P="i32", stride_cb="i32"),
     dict(KP=4, BS=64, DI=128, BP=16), 8, 3),
    ("index_score", dsa_indexer.index_score_kernel, dict(q=BF, w=F32, pool_keys=BF, token_seq=I32, positions=I32,
                                                         out=I64, P="i32", scale="fp32", stride_qt="i32",
                                                         stride_wt="i32"),
     dict(KP=4, HI=32, DI=128, BP=64, IEEE=False), 4, 3),
    ("sparse_mla", sparse_mla.sparse_mla_kernel, MLA,
     dict(R=512, BR=512, BS=64, BH=32, BN=32, SPLIT=1, IEEE=False), 8, 2),
    ("sparse_mla split", sparse_mla.sparse_mla_kernel, MLA,
     dict(R=512, BR=512, BS=64, BH=32, BN=32, SPLIT=16, IEEE=False), 8, 2),
    ("sparse_mla_combine", sparse_mla.sparse_mla_combine_kernel, dict(part_acc=F32, part_ml=F32, o=BF, H="i32"),
     dict(R=512, BR=512, SPLIT=16), 4, 3),
]


def resources(kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    sig = {n: "constexpr" if n in constexprs else args[n] for n in kernel.arg_names}
    src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return dict(registers=int(usage["REG"]), stack_bytes=int(usage["STACK"]),
                shared_bytes=compiled.metadata.shared, num_warps=num_warps, num_stages=num_stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/hotpath_resources.json")
    args = ap.parse_args()
    rows = {}
    for label, kernel, types, constexprs, warps, stages in CASES:
        rows[label] = dict(kernel=kernel.fn.__name__, constexprs=constexprs,
                           **resources(kernel, types, constexprs, warps, stages))
        r = rows[label]
        print(f"{label:22s} regs {r['registers']:3d}  stack {r['stack_bytes']:4d} B  shared {r['shared_bytes']:6d} B  "
              f"warps {warps}{'  uses stack (spills or local arrays)' if r['stack_bytes'] else ''}")
    report = dict(date=datetime.now(timezone.utc).isoformat(), device="sm_90 (compiled on the CPU, no GPU)",
                  triton=triton.__version__, command="python bench/hotpath_resources.py", kernels=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
