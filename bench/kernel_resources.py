"""Registers and stack (spills) a thread of a Triton kernel takes on sm_90, compiled on this machine without a GPU
(the installed Triton's ptxas, read back with its cuobjdump; put the GPU machine's Triton first on PYTHONPATH to see
what it compiles): the KDA prefill conv at the tiles it may run with, this tree's against a given revision's, the
fused MoE's gemm1 at its prefill tiles and the sparse MLA kernel at its tiles.

    PYTHONPATH=/tmp/triton-3.6:$PWD python bench/kernel_resources.py --before f95f6fa \
        --out bench/results/kernel_resources.json
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import triton
from revisions import revision_module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashinfra.feedback.timing import header, write_results
from flashinfra.kernels import fused_moe, sparse_mla
from flashinfra.kernels.kda import conv

CONV_SIGNATURE = dict(x="*bf16", w="*fp32", conv_state="*bf16", y="*bf16", cu_seqlens="*i32", chunk_indices="*i32",
                      state_slots="*i32", has_initial_state="*i32", stride_x="i32", stride_y="i32", C="i32")
TILES = [(64, 128, 4), (32, 128, 4), (64, 128, 8), (32, 128, 8)]  # (BT, BC, warps)
MOE_SIGNATURE = dict(x="*bf16", w="*bf16", h="*bf16", sorted_ids="*i32", expert_ids="*i32", used="*i32", stride_x="i32",
                     stride_we="i32", shared_off="i64", num_pairs="i32", limit="fp32", sx="*bf16", sw="*bf16",
                     stride_se="i32", shared_soff="i64")
MOE_TILES = [(128, 128, 64, 8), (128, 64, 64, 8), (128, 128, 32, 8), (64, 128, 64, 4)]  # (BM, BN, BK, warps)
MLA_SIGNATURE = dict(q="*bf16", latent="*bf16", sel="*i32", token_seq="*i32", block_tables="*i32", o="*bf16",
                     part_acc="*bf16", part_ml="*bf16", stride_qt="i32", stride_qh="i32", S="i32", W="i32", H="i32",
                     CH="i32", scale="fp32", latent_scale="*bf16")
MLA_TILES = [(64, 64, 8), (64, 32, 8), (32, 64, 8)]  # (BH, BN, warps), 2 stages


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3) -> dict:
    """``{"registers": .., "stack_bytes": .., "shared_bytes": ..}`` of ``fn`` compiled for sm_90."""
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    options = dict(num_warps=num_warps, num_stages=num_stages)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dict(registers=int(fields["REG"]), stack_bytes=int(fields["STACK"]), shared_bytes=int(fields["SHARED"]))


def conv_rows(module) -> list[dict]:
    kernel = module.causal_conv1d_prefill_kernel
    extra = {"BH": 4} if "BH" in kernel.arg_names else {}
    return [dict(BT=bt, BC=bc, warps=nw, **resources(kernel, CONV_SIGNATURE, dict(W=4, BT=bt, BC=bc, **extra), nw))
            for bt, bc, nw in TILES]


def moe_rows() -> list[dict]:
    """gemm1 of the 16-bit MoE at the slice's sizes (I 2048, D 4096, 288 experts, top 8 + the shared one)."""
    return [dict(BM=bm, BN=bn, BK=bk, warps=nw,
                 **resources(fused_moe.moe_gemm1_kernel, MOE_SIGNATURE,
                             dict(E=288, N=2048, K=4096, TOPK=9, BM=bm, BN=bn, BK=bk, IEEE=False, WEIGHTS="float"), nw))
            for bm, bn, bk, nw in MOE_TILES]


def mla_rows() -> list[dict]:
    """The sparse MLA kernel over a bf16 latent of rank 512 (64 heads), one split."""
    return [dict(BH=bh, BN=bn, warps=nw,
                 **resources(sparse_mla.sparse_mla_kernel, MLA_SIGNATURE,
                             dict(R=512, BR=512, BS=16, BH=bh, BN=bn, SPLIT=1, IEEE=False, CACHE="float"), nw, 2))
            for bh, bn, nw in MLA_TILES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a git revision whose conv kernel to compile beside this tree's")
    ap.add_argument("--out", default="bench/results/kernel_resources.json")
    args = ap.parse_args()
    report = header() | dict(target=f"sm_90, ptxas of triton {triton.__version__}", before=args.before,
                             shipped=dict(conv=dict(BT=32, BC=128, warps=conv.CONV_PREFILL_WARPS),
                                          moe_gemm1=fused_moe.LARGE_TILES[2]))
    report["now"] = conv_rows(conv)
    if args.before:
        report["before_rows"] = conv_rows(revision_module(args.before, "flashinfra/kernels/kda/conv.py"))
    report["moe_gemm1"] = moe_rows()
    report["sparse_mla"] = mla_rows()
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)
    print("| BT x BC, warps | registers / stack bytes now |" + (" before |" if args.before else ""))
    for i, r in enumerate(report["now"]):
        b = report.get("before_rows", [None] * len(TILES))[i]
        print(f"| {r['BT']} x {r['BC']}, {r['warps']} | {r['registers']} / {r['stack_bytes']} |"
              + (f" {b['registers']} / {b['stack_bytes']} |" if b else ""))
    print("| gemm1 BM x BN x BK, warps | registers / stack bytes |")
    for r in report["moe_gemm1"]:
        print(f"| {r['BM']} x {r['BN']} x {r['BK']}, {r['warps']} | {r['registers']} / {r['stack_bytes']} |")
    print("| sparse MLA BH x BN, warps | registers / stack bytes |")
    for r in report["sparse_mla"]:
        print(f"| {r['BH']} x {r['BN']}, {r['warps']} | {r['registers']} / {r['stack_bytes']} |")


if __name__ == "__main__":
    main()
