"""What a Triton kernel compiles to on sm_90, without a GPU: registers and stack (spills) a thread, shared memory, and
the instructions of its hottest loop (one step of its main loop: tensor-core products, loads, float work), with the
installed Triton's ptxas, read back with its cuobjdump and nvdisasm. Put the GPU machine's Triton first on PYTHONPATH
to see what it compiles.

Each kernel is compiled as the runtime specializes it on a GPU: every pointer and every integer argument the engine
passes as a multiple of 16 carries Triton's 16-divisibility attribute (without it, loads whose addresses it cannot
prove aligned become one element per instruction, and the registers and spills differ from what runs).

Kernels (``KERNELS``): the KDA prefill conv at the tiles it may run with, the fused MoE's gemm1 (bf16, int8, fp8) and
gemm2 (fp8, int8, bf16) at their long-prefill tiles (and bf16's decode tile), the FP8 and W8A8 dense GEMMs at their
decode and prefill tiles, mHC's mix (bf16 and float32), the MoE align's count and layout, the DSA scoring kernel and
the threshold select's count and gather passes, sparse MLA at its tiles. ``--before REV`` compiles that revision's
modules beside this tree's. Each row also lists ``buffer_hazards`` (``mma_buffer_hazards``); ``--hazards`` compiles
them all and lists only those (exit 1 if any: a CI test).

    PYTHONPATH=/tmp/triton-3.6:$PWD python bench/kernel_resources.py --before adf41e1 \
        --out bench/results/kernel_resources.json
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from revisions import revision_module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashinfra.feedback.timing import header, write_results

TOOLS = Path(triton.__file__).parent / "backends/nvidia/bin"
# instruction classes reported for a loop step (SASS opcode prefixes)
CLASSES = {"mma": ("HGMMA", "IGMMA", "QGMMA", "HMMA", "IMMA"), "global_loads": ("LDG", "LDGSTS"),
           "shared": ("LDS", "STS", "LDSM"), "local (spills)": ("LDL", "STL"),
           "float": ("FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "FSEL", "FSETP"), "barriers": ("BAR", "MEMBAR")}


def _spec(module: str, kernel: str, signature: dict, constexprs: dict, divisible: tuple, warps: int, stages: int,
          label: str) -> dict:
    return dict(module=module, kernel=kernel, signature=signature, constexprs=constexprs, divisible=divisible,
                warps=warps, stages=stages, label=label)


MOE1 = dict(x="*bf16", w="*bf16", h="*bf16", sorted_ids="*i32", expert_ids="*i32", used="*i32", stride_x="i32",
            stride_we="i32", shared_off="i64", num_pairs="i32", limit="fp32", sx="*bf16", sw="*bf16", stride_se="i32",
            shared_soff="i64")
MOE2 = dict(h="*fp8e4nv", w="*fp8e4nv", out="*bf16", topk_w="*fp32", sorted_ids="*i32", expert_ids="*i32",
            used="*i32", stride_we="i32", shared_off="i64", num_pairs="i32", sh="*fp32", sw="*fp32", stride_se="i32",
            shared_soff="i64")
MOE_INTS = ("stride_x", "stride_we", "shared_off", "stride_se", "shared_soff")
MOE_SIZES = dict(E=288, K=4096, TOPK=9, IEEE=False)
FP8 = dict(x="*fp8e4nv", w="*fp8e4nv", sx="*fp32", sw="*fp32")
KERNELS = [
    *[_spec("kda/conv", "causal_conv1d_prefill_kernel",
            dict(x="*bf16", w="*fp32", conv_state="*bf16", y="*bf16", cu_seqlens="*i32", chunk_indices="*i32",
                 state_slots="*i32", has_initial_state="*i32", stride_x="i32", stride_y="i32", C="i32"),
            dict(W=4, BT=bt, BC=bc, BH=4, STEPS=8), ("stride_x", "stride_y", "C"), nw, 3,
            f"conv {bt} x {bc}, {nw} warps, 8 tiles")
      for bt, bc, nw in ((64, 128, 4), (32, 128, 4), (64, 128, 8), (32, 128, 8))],
    _spec("fused_moe", "moe_gemm1_kernel", MOE1, dict(N=2048, BM=128, BN=128, BK=64, WEIGHTS="float", **MOE_SIZES),
          MOE_INTS, 8, 3, "MoE gemm1 bf16 128 x 128 x 64"),
    _spec("fused_moe", "moe_gemm1_kernel", dict(MOE1, x="*i8", w="*i8", sx="*fp32", sw="*fp32"),
          dict(N=2048, BM=128, BN=64, BK=128, WEIGHTS="int8", **MOE_SIZES), MOE_INTS, 8, 3,
          "MoE gemm1 int8 128 x 64 x 128"),
    _spec("fused_moe", "moe_gemm1_kernel", dict(MOE1, x="*i8", w="*i8", sx="*fp32", sw="*fp32"),
          dict(N=2048, BM=16, BN=32, BK=128, WEIGHTS="int8", **MOE_SIZES), MOE_INTS, 4, 3,
          "MoE gemm1 int8 16 x 32 x 128 (decode)"),
    _spec("fused_moe", "moe_gemm1_kernel", dict(MOE1, **FP8), dict(N=2048, BM=128, BN=64, BK=128, WEIGHTS="fp8",
                                                                    **MOE_SIZES),
          MOE_INTS, 8, 3, "MoE gemm1 fp8 128 x 64 x 128"),
    _spec("fused_moe", "moe_gemm2_kernel", MOE2, dict(E=288, N=4096, K=2048, TOPK=9, BM=128, BN=128, BK=128,
                                                      IEEE=False, WEIGHTS="fp8"),
          ("stride_we", "shared_off", "stride_se", "shared_soff"), 8, 3, "MoE gemm2 fp8 128 x 128 x 128"),
    *[_spec("quant/gemm", "matmul_8bit_kernel",
            dict(xq="*fp8e4nv", sx="*fp32", wq="*fp8e4nv", sw="*fp32", bias="*fp32", y="*bf16", M="i32", N="i32",
                 K="i32"),
            dict(HAS_BIAS=False, BLOCK_N=128, BM=bm, BN=bn, BK=128, WEIGHTS="fp8"), ("N", "K"), nw, st,
            f"FP8 linear {bm} x {bn}") for bm, bn, nw, st in ((16, 64, 4, 4), (128, 128, 8, 3))],
    *[_spec("mhc", "hc_mix_kernel",
            dict(x=f"*{t}", fn=f"*{t}", part="*fp32", sumsq="*fp32", T="i32", K="i32", KS="i32"),
            dict(NM=24, BT=64, BN=32, BK=bk, IEEE=t == "fp32"), ("K", "KS"), 4, 3, f"mHC mix {t} 64 tokens")
      for t, bk in (("bf16", 128), ("fp32", 64))],
    *[_spec("mhc_expand", "hc_post_kernel",
            dict(x="*bf16", out="*bf16", post="*fp32", comb="*fp32", y="*bf16", fn="*bf16", part="*fp32",
                 sumsq="*fp32", T="i32", D="i32"), dict(N=4, BT=bt, BD=64, MIX=True, NM=24, BN=32), ("D",), 4, 3,
            f"mHC expand with the next mix, {bt} tokens") for bt in (1, 4)],
    *[_spec("fused_moe", "moe_gemm2_kernel", dict(MOE2, h=f"*{t}", w=f"*{t}", sh=s, sw=s),
            dict(E=288, N=4096, K=2048, TOPK=9, BM=bm, BN=bn, BK=bk, IEEE=False, WEIGHTS=fmt),
            ("stride_we", "shared_off", "stride_se", "shared_soff"), nw, st, f"MoE gemm2 {fmt} {bm} x {bn} x {bk}")
      for t, s, fmt, bm, bn, bk, nw, st in (("i8", "*fp32", "int8", 128, 128, 128, 8, 3),
                                            ("bf16", "*bf16", "float", 128, 128, 64, 8, 3),
                                            ("bf16", "*bf16", "float", 16, 64, 128, 4, 4))],
    *[_spec("quant/gemm", "matmul_8bit_kernel",
            dict(xq="*i8", sx="*fp32", wq="*i8", sw="*fp32", bias="*fp32", y="*bf16", M="i32", N="i32", K="i32"),
            dict(HAS_BIAS=False, BLOCK_N=128, BM=bm, BN=bn, BK=bk, WEIGHTS="int8"), ("N", "K"), nw, st,
            f"W8A8 linear {bm} x {bn} x {bk}")
      for bm, bn, bk, nw, st in ((16, 64, 256, 4, 4), (16, 32, 512, 4, 6), (16, 16, 512, 4, 6), (128, 128, 128, 8, 3))],
    _spec("moe_align", "moe_count_kernel", dict(ids="*i32", counts="*i32", num_pairs="i32", E="i32"),
          dict(K=8, E_P2=512, BLOCK=4096), (), 4, 3, "MoE align count, 4,096 pairs"),
    _spec("moe_align", "moe_layout_kernel",
          dict(counts="*i32", sorted_ids="*i32", expert_ids="*i32", starts="*i32", used="*i32",
               num_pairs="i32", E="i32"), dict(BM=128, E_P2=512), (), 4, 3, "MoE align layout"),
    _spec("moe_align", "moe_align_one_kernel",
          dict(ids="*i32", scratch="*i32", sorted_ids="*i32", expert_ids="*i32", used="*i32", num_pairs="i32",
               E="i32"), dict(K=8, E_P2=512, BM=16, BLOCK=2048), (), 4, 3, "MoE align in one program, 2,048 pairs"),
    *[_spec("moe_route", "route_align_kernel",
            dict(logits="*fp32", bias="*fp32", w_out="*fp32", id_out="*i32", scratch="*i32", sorted_ids="*i32",
                 expert_ids="*i32", used="*i32", T="i32", E="i32", scaling="fp32"),
            dict(TOPK=8, G=1, TOPK_GROUP=1, NORM=True, BT=bt, BE=512, TOPK_P2=8, E_P2=512, BM=16, BLOCK=block), (),
            nw, 3, f"route and align, {bt} tokens") for bt, block, nw in ((1, 16, 1), (4, 64, 4))],
    *[_spec("mhc", "hc_pre_kernel",
            dict(x="*bf16", part="*fp32", sumsq="*fp32", base="*fp32", scale="*fp32", y="*bf16", post="*fp32",
                 comb="*fp32", T="i32", D="i32", SPLIT="i32", iters="i32", eps="fp32", norm_eps="fp32", width="i32",
                 w_norm="*bf16", q="*i8", s="*fp32", rms_eps="fp32"),
            dict(N=4, BN=32, BT=1, BD=4096, SP=64, WHOLE=True, NORM=True, CODES=codes, STORE_Y=not codes), ("D",),
            4, 3, f"mHC collapse with the block's norm{' and codes' if codes else ''}, one token")
      for codes in (False, True)],
    _spec("mhc", "hc_collapse_norm_kernel", dict(x="*bf16", w="*bf16", y="*bf16", D="i32", eps="fp32"),
          dict(N=4, BD=4096), ("D",), 8, 3, "final collapse and norm"),
    _spec("dsa_indexer", "index_score_kernel",
          dict(q="*bf16", w="*fp32", pool_keys="*bf16", block_tables="*i32", token_seq="*i32", positions="*i32",
               out="*i32", T="i32", W="i32", P="i32", scale="fp32", stride_qt="i32", stride_wt="i32"),
          dict(KP=4, BS=64, HI=32, DI=128, BT=32, BP=128, QN=2, STAGES=3, IEEE=False), ("W", "P", "stride_qt",
                                                                                      "stride_wt"),
          4, 3, "DSA scoring 32 queries x 128 pools"),
    _spec("dsa_threshold", "threshold_count_kernel",
          dict(scores="*i32", positions="*i32", thresholds="*i64", counts="*i32", P="i32", k="i32"),
          dict(C=4096, M=8, KP=4, NB=16), (), 8, 3, "threshold count, 4096 keys"),
    _spec("dsa_threshold", "threshold_gather_kernel",
          dict(scores="*i32", positions="*i32", thresholds="*i64", counts="*i32", cursor="*i32", cand="*i64", P="i32",
               k="i32"),
          dict(C=4096, M=8, CAP=2048, KP=4), (), 8, 3, "threshold gather, 4096 keys"),
    *[_spec("sparse_mla", "sparse_mla_kernel",
            dict(q="*bf16", latent="*bf16", sel="*i32", token_seq="*i32", block_tables="*i32", o="*bf16",
                 part_acc="*bf16", part_ml="*bf16", stride_qt="i32", stride_qh="i32", S="i32", W="i32", H="i32",
                 CH="i32", scale="fp32", latent_scale="*bf16"),
            dict(R=512, BR=512, BS=64, BH=bh, BN=bn, SPLIT=1, IEEE=False, CACHE="float"),
            ("stride_qt", "stride_qh", "W", "H"), nw, 2, f"sparse MLA {bh} heads x {bn} rows, {nw} warps")
      for bh, bn, nw in ((64, 64, 8), (64, 32, 8), (32, 64, 8))],
]


def _mma(ops) -> int:
    return sum(1 for op in ops if op.startswith(CLASSES["mma"]))


def _sass_loop(text: str) -> tuple[int, collections.Counter]:
    """The main loop's step: of the SASS's backward-branching blocks, the one with the most tensor-core products
    (the first in code order among equals, else the longest); a kernel without a loop counts whole."""
    ins, labels, loops = [], {}, []
    for line in text.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line):
            ins.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)))
    for i, op in enumerate(ins):
        m = re.search(r"BRA\b.*?(L_x_\d+)", op)
        if m and labels.get(m.group(1), i) < i:
            loops.append(ins[labels[m.group(1)]: i + 1])
    best = max(loops, key=lambda b: (_mma(b), 0 if _mma(b) else len(b)), default=ins)
    return len(best), collections.Counter(op.split()[0] for op in best)


def mma_buffer_hazards(ttgir: str) -> list[str]:
    """Pipelined tiles that both a register load (``ttg.local_load``) and an asynchronous tensor-core product
    (``ttng.warp_group_dot``) read from one multi-buffered shared-memory allocation. Triton's pipeliner (3.6 to 3.9
    at least) sizes such an allocation for the register load alone, one slot short of what the still-running MMA
    needs, so the copy of the tile two steps ahead overwrites it under the MMA (``hc_mix_kernel`` gave wrong mHC
    weights for some tokens of a bf16 prompt that way). -> one line per such allocation."""
    allocs = dict(re.findall(r"(%[\w.]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x", ttgir))
    views = dict(re.findall(r"(%[\w.]+) = ttg\.memdesc_index (%[\w.]+)\[", ttgir))
    loaded = set(re.findall(r"ttg\.local_load (%[\w.]+)", ttgir))
    multiplied = {v for line in ttgir.splitlines() if "ttng.warp_group_dot " in line and "isAsync = true" in line
                  for v in re.findall(r"%[\w.]+", line.split("=", 1)[1].split("{", 1)[0])}
    hazards = {views[v] for v in loaded & multiplied if views.get(v) in allocs}
    return [f"{a}: {allocs[a]} buffers read by registers and by an asynchronous MMA" for a in sorted(hazards)]


def compile_kernel(fn, spec: dict) -> dict:
    """Registers, stack, shared bytes and the main loop's instructions of ``fn`` compiled for sm_90 as ``spec``
    says."""
    # an older revision's kernel may lack some of the arguments
    constexprs = {k: v for k, v in spec["constexprs"].items() if k in fn.arg_names}
    # constexprs the spec leaves out take their defaults (``PDL``: off)
    constexprs |= {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default
                   and p.name not in constexprs and p.name not in spec["signature"]}
    runtime = {k: v for k, v in spec["signature"].items() if k in fn.arg_names}
    sig = dict(runtime, **{name: "constexpr" for name in constexprs})
    divisible = [n for n, t in runtime.items() if t.startswith("*")] + [n for n in spec["divisible"] if n in runtime]
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=spec["warps"], num_stages=spec["stages"]))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(item.split(":", 1) for item in next(ln for ln in usage.splitlines() if "REG:" in ln).split()
                  if ":" in item)
    length, ops = _sass_loop(sass)
    classes = {name: sum(n for op, n in ops.items() if op.startswith(prefixes)) for name, prefixes in CLASSES.items()}
    return dict(registers=int(fields["REG"]), stack_bytes=int(fields["STACK"]), shared_bytes=kernel.metadata.shared,
                loop_instructions=length, loop_classes=classes, loop_top=dict(ops.most_common(12)),
                buffer_hazards=mma_buffer_hazards(kernel.asm["ttgir"]))


def rows(before: str | None, only: str = "") -> list[dict]:
    out, modules = [], {}
    for spec in (s for s in KERNELS if only in s["label"]):
        path = f"flashinfra/kernels/{spec['module']}.py"
        for side, rev in (("now", None), ("before", before)):
            if side == "before" and rev is None:
                continue
            key = (path, rev)
            if key not in modules:
                modules[key] = (revision_module(rev, path) if rev else
                                importlib.import_module(f"flashinfra.kernels.{spec['module'].replace('/', '.')}"))
            fn = getattr(modules[key], spec["kernel"], None)
            named = set(spec["signature"]) | set(spec["constexprs"])
            required = {p.name for p in fn.params if not p.has_default} if fn is not None else set()
            if fn is not None and named.issuperset(required):  # a kernel of other arguments is another kernel
                out.append(dict(label=spec["label"], side=side, **compile_kernel(fn, spec)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a git revision whose kernels to compile beside this tree's")
    ap.add_argument("--out", default="bench/results/kernel_resources.json")
    ap.add_argument("--hazards", action="store_true",
                    help="only list the pipelined buffers read by registers and an async MMA (exit 1 if any)")
    ap.add_argument("--only", default="", help="only the kernels whose label contains this text")
    args = ap.parse_args()
    if args.hazards:
        found = [f"{r['label']}: {h}" for r in rows(None) for h in r["buffer_hazards"]]
        print("\n".join(found) or "no pipelined buffer read by registers and by an asynchronous MMA")
        raise SystemExit(1 if found else 0)
    report = header() | dict(target=f"sm_90, ptxas of triton {triton.__version__}", before=args.before,
                             kernels=rows(args.before, args.only))
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)
    print("| kernel | side | registers / stack | shared KB | loop step: instructions (mma, global loads, float, "
          "spills) |\n| --- | --- | --- | --- | --- |")
    for r in report["kernels"]:
        c = r["loop_classes"]
        print(f"| {r['label']} | {r['side']} | {r['registers']} / {r['stack_bytes']} | {r['shared_bytes'] / 1024:.0f} "
              f"| {r['loop_instructions']} ({c['mma']}, {c['global_loads']}, {c['float']}, {c['local (spills)']}) |")


if __name__ == "__main__":
    main()
