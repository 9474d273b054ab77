"""Registers and stack (spills) a thread of a Triton kernel takes on sm_90, compiled on this machine without a GPU
(Triton's own ptxas, read back with its cuobjdump): the KDA prefill conv at the tiles it may run with, this tree's
against a given revision's.

    python bench/kernel_resources.py --before f95f6fa --out bench/results/kernel_resources_conv.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashinfra.feedback.timing import header, write_results
from flashinfra.kernels.kda import conv

REPO = Path(__file__).resolve().parents[1]
CONV_SIGNATURE = dict(x="*bf16", w="*fp32", conv_state="*bf16", y="*bf16", cu_seqlens="*i32", chunk_indices="*i32",
                      state_slots="*i32", has_initial_state="*i32", stride_x="i32", stride_y="i32", C="i32")
TILES = [(64, 128, 4), (32, 128, 4), (64, 128, 8), (32, 128, 8)]  # (BT, BC, warps)


def resources(fn, signature: dict, constexprs: dict, num_warps: int) -> dict:
    """``{"registers": .., "stack_bytes": .., "shared_bytes": ..}`` of ``fn`` compiled for sm_90."""
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
    return dict(registers=int(fields["REG"]), stack_bytes=int(fields["STACK"]), shared_bytes=int(fields["SHARED"]))


def revision_conv(rev: str):
    text = subprocess.run(["git", "show", f"{rev}:flashinfra/kernels/kda/conv.py"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "conv_before.py"
    path.write_text(text)  # triton.jit reads the source through inspect
    spec = importlib.util.spec_from_file_location("conv_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conv_rows(module) -> list[dict]:
    kernel = module.causal_conv1d_prefill_kernel
    extra = {"BH": 4} if "BH" in kernel.arg_names else {}
    return [dict(BT=bt, BC=bc, warps=nw, **resources(kernel, CONV_SIGNATURE, dict(W=4, BT=bt, BC=bc, **extra), nw))
            for bt, bc, nw in TILES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a git revision whose conv kernel to compile beside this tree's")
    ap.add_argument("--out", default="bench/results/kernel_resources_conv.json")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    report = header() | dict(target="sm_90 (ptxas of triton " + triton.__version__ + ")", before=args.before,
                             shipped=dict(BT=32, BC=128, warps=conv.CONV_PREFILL_WARPS))
    report["now"] = conv_rows(conv)
    if args.before:
        report["before_rows"] = conv_rows(revision_conv(args.before))
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)
    print("| BT x BC, warps | registers / stack bytes now |" + (" before |" if args.before else ""))
    for i, r in enumerate(report["now"]):
        b = report.get("before_rows", [None] * len(TILES))[i]
        print(f"| {r['BT']} x {r['BC']}, {r['warps']} | {r['registers']} / {r['stack_bytes']} |"
              + (f" {b['registers']} / {b['stack_bytes']} |" if b else ""))


if __name__ == "__main__":
    main()
