"""How the decode recurrence's state access costs bandwidth: the bare fp32 recurrence (kda_decode's step on a
[K, BV] block, 4 warps) in variants that differ only in how the state block is addressed and cached, with
flash-linear-attention's ``fused_recurrent_kda`` in the same run. CUDA graph, H=64, K=V=128, B=64 and 256.

    python bench/kda_decode_state_access.py --part slots [--out DIR]  -> results/kda_decode_state_slots.json
    python bench/kda_decode_state_access.py --part hints [--out DIR]  -> results/kda_decode_state_hints.json

``slots``: the slot index loaded (random slots, or the identity) or taken as the batch index (no dependent load
before the state load), the new state written in place or to another buffer (as FLA's benchmark call does).
``hints``: in place with random slots, the state load and store under L2 eviction policies and cache modifiers.
(bench/notes/kda_decode.md, "The state read as evict_last".)
``work``: fp32 and bf16 states, in place with random slots and evict_last as shipped, at each dtype's default block
([K, 64] on 4 warps, [K, 32] on 2) and the other: the whole step (as the kernels take it, and in the other
forms of ``recurrence_variant_kernel``'s WORK), the step's decay alone (the block read, scaled
per row and written back: the same bytes and addressing with almost no arithmetic), and the decay with the first
reduction and the update (no output): how much of the step's time the access pattern alone takes.

    python bench/kda_decode_state_access.py --part work [--out DIR]   -> results/kda_decode_state_work.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import copy_bandwidth_GBps, header, time_graph, write_results  # noqa: E402
from kda_decode_prologue import _add2  # noqa: E402  (the pairwise sum for a reduction over two values)

from flashinfra.kernels.kda.common import state_step  # noqa: E402

H, K, V = 64, 128, 128


@triton.jit
def recurrence_variant_kernel(q, k, v, g, beta, o, state, state_out, state_slots, scale,
                              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                              DIRECT: tl.constexpr, OUTPLACE: tl.constexpr, LEV: tl.constexpr = "",
                              SEV: tl.constexpr = "", SCM: tl.constexpr = "", WORK: tl.constexpr = "step"):
    """kda_decode_kernel's step on one [K, BV] block (K, V multiples of the block), its state access varied;
    WORK: "step" (the whole step as the kernels take it: the output stored, then the state; "qout" the same with
    q's norm factor applied to the output instead of q), "step_sfirst" (the
    state stored before the output's reduction), "two_sums" / "pair" (both sums over K from the decayed block,
    ``o = q^T S + (q . k) delta``, as two reductions / one over the pair, the state stored first), "decay" (the
    block times exp(g) only) or "update" (no output)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if DIRECT:
        slot = i_b.to(tl.int64)
    else:
        slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    off = (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(state + off, eviction_policy=LEV).to(tl.float32)
    b_q = tl.load(q + i_bh * K + o_k).to(tl.float32)
    b_k = tl.load(k + i_bh * K + o_k).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v).to(tl.float32)
    b_g = tl.load(g + i_bh * K + o_k)
    b_beta = tl.load(beta + i_bh)
    r_q = scale / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
    if WORK != "qout":
        b_q = b_q * r_q
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_o = tl.zeros([BV], dtype=tl.float32)
    if WORK == "step" or WORK == "qout":  # as the kernels do: the output stored first; "qout": q's factor on it
        b_s, b_o = state_step(b_s, b_q, b_k, tl.exp(b_g), b_beta, b_v)
        if WORK == "qout":
            b_o = b_o * r_q
        tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty))
    elif WORK == "decay":
        b_s = b_s * tl.exp(b_g)[:, None]
    elif WORK == "two_sums" or WORK == "pair":  # o = q^T S + (q . k) delta, both sums over the decayed block
        b_s = b_s * tl.exp(b_g)[:, None]
        if WORK == "pair":
            b_ks, b_qs = tl.reduce((b_s * b_k[:, None], b_s * b_q[:, None]), 0, _add2)
        else:
            b_ks, b_qs = tl.sum(b_s * b_k[:, None], 0), tl.sum(b_s * b_q[:, None], 0)
        b_delta = (b_v - b_ks) * b_beta
        b_s += b_k[:, None] * b_delta[None, :]
        b_o = b_qs + tl.sum(b_q * b_k) * b_delta
    else:  # "update" (no output) or "step_sfirst" (the output's reduction after the state's store)
        b_s = b_s * tl.exp(b_g)[:, None]
        b_s += b_k[:, None] * ((b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta)[None, :]
    b_new = b_s.to(state.dtype.element_ty)
    if OUTPLACE:
        tl.store(state_out + (i_bh * K * V + o_k[:, None] * V + o_v[None, :]), b_new)
    else:
        tl.store(state + off, b_new, eviction_policy=SEV, cache_modifier=SCM)
    if WORK == "step_sfirst":
        b_o = tl.sum(b_s * b_q[:, None], 0)
    if WORK == "step_sfirst" or WORK == "two_sums" or WORK == "pair":
        tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty))


def variants(part: str):
    """(name, launch options, which slots) per variant of the part."""
    if part == "work":
        for dt in ("fp32", "bf16"):
            for bv, nw in ((64, 4), (32, 2)):
                for work in ("step", "step_sfirst", "two_sums", "pair", "decay", "update"):
                    yield (f"{dt}_BV{bv}_w{nw}_{work}",
                           dict(BV=bv, num_warps=nw, DIRECT=False, OUTPLACE=False, LEV="evict_last", WORK=work, dt=dt),
                           "perm")
        # bf16 [K, 64] tiles on 4 warps at 96 registers (five programs per SM instead of four): the step as the kernels
        # take it (spills 24 bytes) and with q's norm factor applied to the output (no spill)
        for work, cap in (("qout", None), ("qout", 96), ("step", 96)):
            yield (f"bf16_BV64_w4_{work}" + (f"_r{cap}" if cap else ""),
                   dict(BV=64, num_warps=4, DIRECT=False, OUTPLACE=False, LEV="evict_last", WORK=work, dt="bf16",
                        **({"maxnreg": cap} if cap else {})), "perm")
        return
    if part == "slots":
        for bv in (32, 64):
            for direct in (False, True):
                for outp in (False, True):
                    for slots in (("ident",) if direct else ("perm", "ident")):
                        name = (f"BV{bv}_w4_{'direct' if direct else 'load_' + slots}_"
                                f"{'outplace' if outp else 'inplace'}")
                        yield name, dict(BV=bv, DIRECT=direct, OUTPLACE=outp), slots
        return
    hints = (("none", {}), ("lev_first", dict(LEV="evict_first")), ("sev_first", dict(SEV="evict_first")),
             ("scs", dict(SCM=".cs")), ("lev_sev_first", dict(LEV="evict_first", SEV="evict_first")),
             ("lev_last", dict(LEV="evict_last")), ("swt", dict(SCM=".wt")),
             ("lev_last_swt", dict(LEV="evict_last", SCM=".wt")))
    for bv in (64, 32):
        for tag, hint in hints:
            for outp in ((False, True) if tag == "none" else (False,)):
                name = f"BV{bv}_w4_perm_{'outplace' if outp else 'inplace'}_{tag}"
                yield name, dict(BV=bv, DIRECT=False, OUTPLACE=outp, **hint), "perm"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("slots", "hints", "work"), required=True)
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    from fla.ops.kda import fused_recurrent_kda

    res = header()
    res["copy_GBps"] = copy_bandwidth_GBps()
    res["rows"] = []
    for B in (64, 256):
        row = {"B": B}
        q = torch.randn(B, H, K, device="cuda", dtype=torch.bfloat16)
        k, v = torch.randn_like(q), torch.randn_like(q)
        g = (-5 * torch.sigmoid(torch.randn(B, H, K, device="cuda"))).float()
        beta = torch.rand(B, H, device="cuda")
        state = torch.randn(B + 3, H, K, V, device="cuda") * 0.1
        states = {"fp32": state, "bf16": state.bfloat16()}
        slots = {"perm": torch.randperm(B + 3, device="cuda")[:B].to(torch.int32),
                 "ident": torch.arange(B, device="cuda", dtype=torch.int32)}
        state_out = torch.empty(B, H, K, V, device="cuda")
        o = torch.empty(B, H, V, device="cuda", dtype=torch.bfloat16)
        for name, opts, which in variants(args.part):
            bv, nw, st = opts.pop("BV"), opts.pop("num_warps", 4), states[opts.pop("dt", "fp32")]
            row[name] = time_graph(lambda s=slots[which], bv=bv, nw=nw, st=st, opts=opts: recurrence_variant_kernel[
                (V // bv, B * H)](q, k, v, g, beta, o, st, state_out, s, K**-0.5, H=H, K=K, V=V, BV=bv, num_warps=nw,
                                  **opts))
            if args.part == "work":
                row[name + "_frac_copy"] = B * H * K * V * 2 * st.element_size() / row[name] / 1e3 / res["copy_GBps"]
        h0 = state[:B].clone()
        row["fla"] = time_graph(lambda: fused_recurrent_kda(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.bfloat16().unsqueeze(1),
            scale=K**-0.5, initial_state=h0, output_final_state=True))
        res["rows"].append(row)
        print(B, {n: round(t, 3 if n.endswith("copy") else 1) for n, t in row.items() if n != "B"}, flush=True)
    write_results(f"kda_decode_state_{args.part}", res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
