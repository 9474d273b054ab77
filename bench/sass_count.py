"""A Triton kernel of flashinfra compiled for the H200 (sm_90) on any machine, without a GPU: its SASS
instruction count, registers and stack (spills), the most frequent opcodes and, with ``--lines``, the
instructions per source line. The instruction counts in bench/notes (for example "760 instructions and 83
registers") come from this, with the Triton version the GPU machine runs (3.6: ``pip install --target DIR
triton==3.6.0`` and ``PYTHONPATH=DIR``).

Pointer and stride arguments are compiled as 16-byte aligned, as Triton specialises them at a real launch.
The presets are the decode kernels at H=64, K=V=128, bf16 activations; ``NAME=VALUE`` overrides a constexpr
(``state=fp32``, ``o=fp32``: a pointer argument's element type; ``ai_d=tensordesc<bf16[64,64]>``: a
descriptor's).

    python bench/sass_count.py decode [--warps 4] [--maxnreg 96] [--lines] [BV=64 EVEN=True ...]
        presets: decode (kda_decode_kernel), tiles (kda_layer_decode_tile_kernel), block
        (kda_layer_decode_block_kernel), prep (kda_layer_decode_prep_heads_kernel), intra_a (the prefill's kernel A,
        kda_intra64_offdiag_rows_kernel, at the launcher's K slices of 32, two deep), intra_d (kernel D,
        kda_intra64_diag_kernel: K slices of 32, qg and kd into the bf16x3 chain's slots; ``--warps 2 --stages 1
        --maxnreg 128``), intra_b (kernel B, kda_intra64_b_kernel:
        key blocks of 32, value blocks of 64, three deep; ``--maxnreg 168``; u formed here, as for a float32
        output), intra_b_u (the same with u left to the state pass: the launcher's default, ``u_in_state``), state
        (the prefill's state pass, kda_state64_kernel, at the launcher's value blocks of 64 and bf16x3 chain,
        reading u; ``--stages 2`` for its ring), state_u (the same forming u from v and Aib: the default)
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE = dict(H=64, K=128, V=128, BK=128)
PRESETS = {
    "decode": ("flashinfra.kernels.kda.decode_recurrence:kda_decode_kernel",
               "q:*bf16 k:*bf16 v:*bf16 g:*fp32 beta:*fp32 o:*bf16 state:*bf16 state_slots:*i32 stride_q_b:i32 "
               "stride_q_h:i32 stride_k_b:i32 stride_k_h:i32 stride_v_b:i32 stride_v_h:i32 scale:fp32",
               dict(SHAPE, BV=64, DOT_SUMS=True, DOT_F32=False, EVEN=True)),
    "tiles": ("flashinfra.kernels.kda.decode_stream:kda_layer_decode_tile_kernel",
              "state:*bf16 heads:*fp32 state_slots:*i32 out:*bf16 gate:*bf16 norm_w:*bf16 eps:fp32 stride_gate:i32",
              dict(SHAPE, BV=64, R=128, NORM=False, DOT_SUMS=True, DOT_F32=False, EVEN=True)),
    "block": ("flashinfra.kernels.kda.decode:kda_layer_decode_block_kernel",
              "qkv:*bf16 conv_w:*fp32 conv_state:*bf16 g_raw:*bf16 beta_logits:*bf16 A_log:*fp32 dt_bias:*fp32 "
              "lower_bound:fp32 state:*fp32 state_slots:*i32 out:*bf16 heads:*fp32 stride_x:i32 stride_g:i32 "
              "stride_b:i32 scale:fp32",
              dict(SHAPE, BV=64, W=4, BW=4, HAS_LOWER_BOUND=True, PREPPED=True, EVEN=True)),
    "prep": ("flashinfra.kernels.kda.decode_prep:kda_layer_decode_prep_heads_kernel",
             "qkv:*bf16 conv_w:*fp32 conv_state:*bf16 g_raw:*bf16 beta_logits:*bf16 A_log:*fp32 dt_bias:*fp32 "
             "lower_bound:fp32 state_slots:*i32 heads:*fp32 stride_x:i32 stride_g:i32 stride_b:i32 scale:fp32",
             dict(SHAPE, W=4, HAS_LOWER_BOUND=True, R=128, HB=1, PREP_V=False, BVF=128, EVICT="")),
    "intra_a": ("flashinfra.kernels.kda.prefill_intra_offdiag:kda_intra64_offdiag_rows_kernel",
                "bc:*fp32 cu_seqlens:*i32 chunk_indices:*i32 aqk:*bf16 ai:*fp32 rn:*fp32 q_d:tensordesc<bf16[16,32]> "
                "k_d:tensordesc<bf16[16,32]> gc_d:tensordesc<fp32[16,32]> aib:*bf16",
                dict(H=64, K=128, KS=32, LOCAL_PRECISION="tf32", SOLVE_PRECISION="bf16x3", FAST_EXP=True, A_LO=1,
                     DOT_F32=False, STAGES=2)),
    "intra_d": ("flashinfra.kernels.kda.prefill_intra_diag:kda_intra64_diag_kernel",
                "q:*bf16 k:*bf16 gc:*fp32 bc:*fp32 cu_seqlens:*i32 chunk_indices:*i32 aqk:*bf16 ai:*fp32 rn:*fp32 "
                "stride_q_t:i32 stride_k_t:i32 scale:fp32 wqk:*bf16 egl:*fp32",
                dict(H=64, K=128, KS=32, LOCAL_PRECISION="tf32", A_LO=1, FAST_EXP=True, NS=5, SQ=2, SKD=3, Q_LO=False,
                     KD_LO=True)),
    "intra_b": ("flashinfra.kernels.kda.prefill_intra_w:kda_intra64_b_kernel",
                "bc:*fp32 cu_seqlens:*i32 chunk_indices:*i32 rn:*fp32 gc:*fp32 wqk:*bf16 u:*fp32 egl:*fp32 "
                "k_d:tensordesc<bf16[64,32]> v_d:tensordesc<bf16[64,64]> "
                "gc_d:tensordesc<fp32[64,32]> ai_d:tensordesc<fp32[64,64]>",
                dict(H=64, K=128, V=128, BK=32, BVB=64, PRECISION="tf32", W_LO=1, NS=5, DOT_F32=False, STAGES=3)),
    "state": ("flashinfra.kernels.kda.prefill_state:kda_state64_kernel",
              "wqk:tensordesc<bf16[64,128]> u:tensordesc<fp32[64,64]> aqk:tensordesc<bf16[64,64]> egl:*fp32 o:*bf16 "
              "state:tensordesc<fp32[128,64]> cu_seqlens:*i32 chunk_offsets:*i32 state_slots:*i32 "
              "has_initial_state:*i32 wqk_p:*bf16 u_p:*fp32 aqk_p:*bf16 v:*bf16 stride_v:i32",
              dict(H=64, K=128, V=128, BV=64, CHAIN=3, OUT_X3=False, NS=5, SQ=2, SKD=3, A_LO=1, DOT_F32=False)),
}
# the state pass forming u itself (``u_in_state``): ``u`` is then over Aib's bf16 pair, and Aqk has no lo half
PRESETS["state_u"] = (PRESETS["state"][0],
                      PRESETS["state"][1].replace("u:tensordesc<fp32[64,64]>", "u:tensordesc<bf16[64,64]>")
                      .replace("u_p:*fp32", "u_p:*bf16"),
                      dict(PRESETS["state"][2], A_LO=0, U_IN_STATE=True, L2_AHEAD=1))
# the state pass applying w's product itself (``w_in_state``: w's slots hold -kg), and kernel D writing -kg
PRESETS["state_w"] = (PRESETS["state_u"][0], PRESETS["state_u"][1], dict(PRESETS["state_u"][2], W_IN_STATE=True))
PRESETS["intra_d_kg"] = (PRESETS["intra_d"][0], PRESETS["intra_d"][1],
                         dict(PRESETS["intra_d"][2], A_LO=0, KG=True, W_LO=True))
# kernel B leaving u to the state pass (``u_in_state``): its Ai descriptor over Aib's bf16 pair
PRESETS["intra_b_u"] = (PRESETS["intra_b"][0],
                        PRESETS["intra_b"][1].replace("ai_d:tensordesc<fp32[64,64]>", "ai_d:tensordesc<bf16[64,64]>"),
                        dict(PRESETS["intra_b"][2], AIB=True))
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+([@A-Z].*)")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def compile_sm90(preset: str, overrides: dict, num_warps: int, maxnreg: int | None, num_stages: int = 3):
    """The compiled kernel (Triton's CompiledKernel) for sm_90, and the kernel function."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path, signature, constexprs = PRESETS[preset]
    module, name = path.split(":")
    fn = getattr(importlib.import_module(module), name)
    sig = dict(item.split(":") for item in signature.split())
    for name in [n for n, v in overrides.items() if n in sig and not isinstance(v, (bool, int))]:
        kind = overrides.pop(name)  # a pointer argument's element type (state=fp32), or a descriptor's type
        sig[name] = kind if kind.startswith("tensordesc") else "*" + kind
    # constexprs left at their defaults are given too (newer Triton versions do not fill them in here)
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs, **overrides}
    sig.update({n: "constexpr" for n in constexprs})
    names = fn.arg_names
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
               if t.startswith("*") or n.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=aligned)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), fn


def count(compiled, fn, lines: bool) -> dict:
    """Instructions, registers, stack bytes, opcodes and (``lines``) instructions per source line."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "--print-line-info", cubin], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", usage).groups()
    ops, per_line, where = collections.Counter(), collections.Counter(), None
    for text in sass[sass.index(".text." + fn.__name__):].splitlines():
        found = LINE.search(text)
        if found:
            where = f"{os.path.basename(found.group(1))}:{found.group(2)}"
            continue
        ins = INSTRUCTION.match(text)
        if ins:
            words = ins.group(1).split()
            ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0].rstrip(";")] += 1
            per_line[where] += 1
    res = {"instructions": sum(ops.values()), "registers": int(regs), "stack_bytes": int(stack),
           "shared_bytes": compiled.metadata.shared,
           "opcodes": dict(ops.most_common())}
    if lines:
        res["lines"] = dict(per_line.most_common(20))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("overrides", nargs="*",
                    help="NAME=VALUE constexprs, or a pointer argument's element type (state=fp32)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int)
    ap.add_argument("--stages", type=int, default=3, help="num_stages (the state pass's ring: 2 at bf16x3)")
    ap.add_argument("--lines", action="store_true", help="also the instructions per source line")
    args = ap.parse_args()
    overrides = {k: _value(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    compiled, fn = compile_sm90(args.preset, overrides, args.warps, args.maxnreg, args.stages)
    res = count(compiled, fn, args.lines)
    print(f"{args.preset} {' '.join(args.overrides)} warps={args.warps} maxnreg={args.maxnreg}: "
          f"{res['instructions']} instructions, {res['registers']} registers, {res['stack_bytes']} bytes of stack, "
          f"{res['shared_bytes']} bytes of shared memory")
    print("opcodes:", dict(list(res["opcodes"].items())[:12]))
    for where, n in res.get("lines", {}).items():
        print(f"{n:6d}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
