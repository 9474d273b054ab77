"""The bare decode recurrence with each state column's K inside one warp (Gluon, explicit layout), against the
shipped kernel and flash-linear-attention's fused_recurrent_kda in the same run. CUDA graph, H=64, K=V=128.

Why: Triton lays a [K, BV] state tile out with its warps along K, so each of the step's sums over K (k^T S, then
the output's q^T S) and q's and k's norms cross warps through shared memory behind barriers: 19 barriers per
program in the bare kernel. `bench/kda_decode_state_access.py --part work` measured a bf16 [K, 64] program at 72.4 us
at B=64 without its output and 96.3 us with it (bench/notes/kda_decode.md, "What the bf16 step's output costs").
Here the layout is explicit: ``size_per_thread [K / LANES_K, BV / (LANES_V * WARPS)]``, ``threads_per_warp
[LANES_K, LANES_V]``, ``warps_per_cta [1, WARPS]``; every sum over K is in-thread plus shuffles, and the program
has no barrier and no shared memory (compiled for sm_90 with Triton 3.6: bf16 [K, 64] on 4 warps 808 instructions
and 96 registers, against 936 and 117 for the shipped kernel at that shape).

The ``tma_*`` variants use the same layouts over a block that the copy engine copies into shared memory and back
(whole 128-byte lines per request), to separate the layout's arithmetic from its access pattern.

Measured slower than the shipped kernels in every form (bench/notes/kda_decode.md, "Each column's K inside one warp,
measured"); kept as the record of that result.

``--part layer``: the layer (bench/kda_decode.py's inputs) as two launches, the shipped prep launch and one
program per head holding the whole [K, V] state in that layout (V across the warps) that also applies the gated
RMSNorm, whose sum over V is the program's only cross-warp step: the norm launch is gone (at B=64 the fp32 layer is
prep ~10 + state ~135 + norm ~3-4 us; 90% of copy is about 146.4 us).

Each variant is first checked against float64 (the recurrence, or kda_layer_decode_ref for the layer; outputs
poisoned before the call, a bf16 or fp32 state updated in place through random slots), then timed.

    python bench/kda_decode_warp_k.py [--part bare|layer] [--batches 64,256] [--out DIR]
        -> bench/results/kda_decode_warp_k.json, kda_decode_warp_k_layer.json
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import part_main, relerr, time_graph  # noqa: E402

from kda_decode import layer_inputs, layer_reference, time_layer_variant  # noqa: E402

from flashinfra.kernels.kda.decode_recurrence import kda_decode_launch, kda_decode_ref  # noqa: E402
from flashinfra.kernels.kda.decode import kda_layer_decode_launch  # noqa: E402
from flashinfra.kernels.kda.decode_prep import prep_heads_launch  # noqa: E402

H, K, V = 64, 128, 128
# (BV, LANES_V, WARPS) per state dtype: value columns per program, lanes along V in a warp, warps along V
VARIANTS = {"bf16": [(64, 2, 4), (32, 2, 2), (32, 1, 4), (128, 2, 8), (64, 1, 8), (16, 2, 1)],
            "fp32": [(64, 2, 4), (32, 2, 2), (128, 2, 8), (16, 2, 1)]}
# the same layouts over a tile copied in and out by the copy engine (rows of 64 bytes or more: swizzled banks)
TMA_VARIANTS = {"bf16": [(64, 2, 4), (32, 2, 2), (32, 1, 4), (128, 2, 8), (64, 1, 8)],
                "fp32": [(32, 2, 2), (32, 1, 4), (16, 1, 2)]}
# the copy engine's copies: ``async_load`` / ``async_store`` from Triton 3.7 on
_copy_in = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_copy_out = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# (LANES_V, WARPS) of the layer's head kernel (a whole [K, V] head per program): compiled for sm_90, fp32 state
# 116 / 56 registers, 2 barriers (the norm's sum over V), no spills
LAYER_VARIANTS = [(2, 8), (1, 16)]


@gluon.jit
def _head_vectors(q, k, v, g, beta, i_b, i_h, i_bh, o_k, o_v, stride_q_b, stride_q_h, stride_k_b, stride_k_h,
                  stride_v_b, stride_v_h, scale, K: gl.constexpr):
    """One head's step inputs in the block's row (``o_k``) and column (``o_v``) layouts: q and its norm factor, k
    normalised, v, g and beta, float32."""
    b_q = gl.load(q + i_b * stride_q_b + i_h * stride_q_h + o_k).to(gl.float32)
    b_k = gl.load(k + i_b * stride_k_b + i_h * stride_k_h + o_k).to(gl.float32)
    b_v = gl.load(v + i_b * stride_v_b + i_h * stride_v_h + o_v).to(gl.float32)
    b_g = gl.load(g + i_bh * K + o_k).to(gl.float32)
    b_beta = gl.load(beta + i_bh).to(gl.float32)
    r_q = scale / gl.sqrt(gl.sum(b_q * b_q, 0) + 1e-6)
    return b_q, r_q, b_k / gl.sqrt(gl.sum(b_k * b_k, 0) + 1e-6), b_v, b_g, b_beta


@gluon.jit
def _step(b_s, b_q, r_q, b_k, b_v, b_g, b_beta):
    """The delta-rule step on a float32 [K, BV] block: the new block and its [BV] output."""
    b_s = b_s * gl.exp(b_g)[:, None]
    b_s = b_s + b_k[:, None] * ((b_v - gl.sum(b_s * b_k[:, None], 0)) * b_beta)[None, :]
    return b_s, gl.sum(b_s * b_q[:, None], 0) * r_q


@gluon.jit
def kda_decode_warp_k_kernel(
    q, k, v, g, beta, o, state, state_slots, stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    scale, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, layout: gl.constexpr,
):
    """Grid (V / BV, B * H): ``kda_decode_kernel``'s step (kda_decode.py) on a [K, BV] block whose columns each lie
    in one warp. K and V must be multiples of the layout's extent (no masks)."""
    i_v, i_bh = gl.program_id(0), gl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = gl.load(state_slots + i_b).to(gl.int64)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, layout))
    o_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
    p_s = state + (slot * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s = gl.load(p_s, eviction_policy="evict_last")
    b_q, r_q, b_k, b_v, b_g, b_beta = _head_vectors(q, k, v, g, beta, i_b, i_h, i_bh, o_k, o_v, stride_q_b,
                                                    stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h, scale,
                                                    K)
    b_s, b_o = _step(b_s.to(gl.float32), b_q, r_q, b_k, b_v, b_g, b_beta)
    gl.store(p_s, b_s.to(state.dtype.element_ty))
    gl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty))


@gluon.jit
def kda_decode_tma_kernel(
    q, k, v, g, beta, o, state_d, state_slots, stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    scale, H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, layout: gl.constexpr,
):
    """``kda_decode_warp_k_kernel``'s step with the [K, BV] block copied into shared memory and back by the copy
    engine (whole 128-byte lines per request) and read and written there in the warp-K layout: one barrier
    (before the copy out), no cross-warp sums."""
    i_v, i_bh = gl.program_id(0), gl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = gl.load(state_slots + i_b)
    row = (slot * H + i_h) * K
    tile = gl.allocate_shared_memory(state_d.dtype, [K, BV], state_d.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, state_d.block_type.nbytes)
    _copy_in(state_d, [row, i_v * BV], bar, tile)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, layout))
    o_v = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
    b_q, r_q, b_k, b_v, b_g, b_beta = _head_vectors(q, k, v, g, beta, i_b, i_h, i_bh, o_k, o_v, stride_q_b,
                                                    stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h, scale,
                                                    K)
    mbarrier.wait(bar, 0)
    b_s, b_o = _step(tile.load(layout).to(gl.float32), b_q, r_q, b_k, b_v, b_g, b_beta)
    tile.store(b_s.to(state_d.dtype))
    fence_async_shared()
    gl.thread_barrier()
    _copy_out(state_d, [row, i_v * BV], tile)
    gl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty))
    tma.store_wait(0)
    mbarrier.invalidate(bar)


@gluon.jit
def kda_layer_head_warp_k_kernel(
    state, heads, state_slots, out, gate, norm_w, eps, stride_gate,
    H: gl.constexpr, K: gl.constexpr, V: gl.constexpr, R: gl.constexpr, layout: gl.constexpr,
):
    """Grid (B * H,): one head's [K, V] state from the prep scratch ``heads`` ([B * H, 5, R]: q scaled, k, decay,
    v, beta; kda_layer_decode.py's "tiles" layout), its columns' K inside one warp, then the gated RMSNorm of the
    output row (rounded to ``out``'s dtype first, as the norm launch reads it)."""
    i_bh = gl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = gl.load(state_slots + i_b).to(gl.int64)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, layout))
    o_v = gl.arange(0, V, layout=gl.SliceLayout(0, layout))
    p_s = state + (slot * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s = gl.load(p_s, eviction_policy="evict_last")
    p_h = heads + i_bh * (5 * R)
    b_q = gl.load(p_h + o_k, eviction_policy="evict_first")
    b_k = gl.load(p_h + R + o_k, eviction_policy="evict_first")
    b_decay = gl.load(p_h + 2 * R + o_k, eviction_policy="evict_first")
    b_v = gl.load(p_h + 3 * R + o_v, eviction_policy="evict_first")
    b_beta = gl.load(p_h + 4 * R, eviction_policy="evict_first")
    b_s = b_s.to(gl.float32) * b_decay[:, None]
    b_s = b_s + b_k[:, None] * ((b_v - gl.sum(b_s * b_k[:, None], 0)) * b_beta)[None, :]
    gl.store(p_s, b_s.to(state.dtype.element_ty))
    b_o = gl.sum(b_s * b_q[:, None], 0).to(out.dtype.element_ty).to(gl.float32)
    b_o = b_o / gl.sqrt(gl.sum(b_o * b_o, 0) / V + eps)
    b_gate = gl.load(gate + i_b * stride_gate + i_h * V + o_v).to(gl.float32)
    b_o = b_o * gl.load(norm_w + o_v).to(gl.float32) / (1.0 + gl.exp(-b_gate))
    gl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty))


def warp_k_layout(cols: int, lanes_v: int, warps: int) -> gl.BlockedLayout:
    """A [K, cols] block with each column's K inside one warp: ``lanes_v`` lanes and ``warps`` warps along the
    columns, the warp's other lanes along K."""
    lanes_k = 32 // lanes_v
    return gl.BlockedLayout(size_per_thread=[K // lanes_k, cols // (lanes_v * warps)],
                            threads_per_warp=[lanes_k, lanes_v], warps_per_cta=[1, warps], order=[1, 0])


def warp_k_layer(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound, norm_weight,
                 eps, state, state_slots, LANES_V: int = 2, WARPS: int = 8):
    """The layer as the shipped prep launch (one head per program, 4 warps) and the head kernel above."""
    B = qkv.shape[0]
    W = conv_weight.shape[-1]
    out = torch.empty(B, H, V, device=qkv.device, dtype=qkv.dtype)
    heads = torch.empty(B * H, 5, max(K, V), device=qkv.device, dtype=torch.float32)
    sizes = dict(H=H, K=K, V=V, BK=K, W=W, BW=triton.next_power_of_2(W - 1))
    lb = 0.0 if lower_bound is None else float(lower_bound)
    prep_heads_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, A_log, dt_bias.float(), lb, state_slots, heads,
                      sizes, lower_bound is not None, max(K, V), True, V, "", 1, 4)
    kda_layer_head_warp_k_kernel[(B * H,)](
        state, heads, state_slots, out, gate, norm_weight, float(eps), gate.stride(0), H=H, K=K, V=V, R=max(K, V),
        layout=warp_k_layout(V, LANES_V, WARPS), num_warps=WARPS)
    return out


def warp_k_launch(q, k, v, g, beta, state, slots, o, BV: int, LANES_V: int, WARPS: int):
    B = q.shape[0]
    kda_decode_warp_k_kernel[(V // BV, B * H)](
        q, k, v, g, beta, o, state, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), K**-0.5, H=H, K=K, V=V, BV=BV, layout=warp_k_layout(BV, LANES_V, WARPS), num_warps=WARPS)
    return o


def tma_launch(q, k, v, g, beta, state, slots, o, BV: int, LANES_V: int, WARPS: int):
    B = q.shape[0]
    dt = gl.bfloat16 if state.dtype == torch.bfloat16 else gl.float32
    tile = gl.NVMMASharedLayout.get_default_for([K, BV], dt)
    state_d = TensorDescriptor.from_tensor(state.view(-1, V), [K, BV], tile)
    kda_decode_tma_kernel[(V // BV, B * H)](
        q, k, v, g, beta, o, state_d, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), K**-0.5, H=H, K=K, V=V, BV=BV, layout=warp_k_layout(BV, LANES_V, WARPS), num_warps=WARPS)
    return o


def recurrence_f64(q, k, v, g, beta, state, slots):
    """One step in float64 (``kda_decode_ref`` on float64 copies): the output and the new states of the slots."""
    s64 = state.double().clone()
    o = kda_decode_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), s64, slots)
    return o, s64[slots.long()]


def fla_recurrence_us(q, k, v, g, beta, h0) -> dict:
    try:
        from fla.ops.kda import fused_recurrent_kda
    except ImportError as exc:
        return {"fla_error": repr(exc)}
    return {"fla_fp32_graph_us": time_graph(lambda: fused_recurrent_kda(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.bfloat16().unsqueeze(1),
        scale=K**-0.5, initial_state=h0, output_final_state=True))}


def bare_row(B: int) -> dict:
    """The bare recurrence's variants, the shipped kernel and FLA's fp32 recurrence at batch B."""
    torch.manual_seed(B)
    q = torch.randn(B, H, K, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    g = (-5 * torch.sigmoid(torch.randn(B, H, K, device="cuda"))).float()
    beta = torch.rand(B, H, device="cuda")
    slots = torch.randperm(B + 3, device="cuda")[:B].to(torch.int32)
    base = torch.randn(B + 3, H, K, V, device="cuda") * 0.1
    o = torch.empty(B, H, V, device="cuda", dtype=torch.bfloat16)
    row = {"B": B}
    for dt, sdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        state = base.to(sdt)
        ref_o, ref_s = recurrence_f64(q, k, v, g, beta, state, slots)
        cases = {f"warp_k_{dt}_BV{bv}_l{lv}_w{w}": (lambda st, bv=bv, lv=lv, w=w: warp_k_launch(
            q, k, v, g, beta, st, slots, o, bv, lv, w)) for bv, lv, w in VARIANTS[dt]}
        cases |= {f"tma_{dt}_BV{bv}_l{lv}_w{w}": (lambda st, bv=bv, lv=lv, w=w: tma_launch(
            q, k, v, g, beta, st, slots, o, bv, lv, w)) for bv, lv, w in TMA_VARIANTS[dt]}
        cases[f"shipped_{dt}"] = lambda st: kda_decode_launch(q, k, v, g, beta, st, slots, out=o)
        for name, fn in cases.items():
            st = state.clone()
            o.fill_(float("nan"))
            fn(st)
            row[name + "_relerr_o"] = relerr(o, ref_o)
            row[name + "_relerr_state"] = relerr(st[slots.long()], ref_s)
            row[name + "_graph_us"] = time_graph(lambda fn=fn, st=st: fn(st))
    row |= fla_recurrence_us(q, k, v, g, beta, base[slots.long()].clone())
    for key in [k_ for k_ in row if k_.endswith("_graph_us")]:
        row[key.replace("_graph_us", "_frac_copy")] = B * H * K * V * 2 * (2 if "bf16" in key else 4) / row[key] / 1e3
    return row


def layer_row(B: int) -> dict:
    """The layer as prep + head kernel (two launches) and the shipped layer, both state dtypes, at batch B."""
    row = {"B": B}
    for dt, sdt, es in (("fp32", torch.float32, 4), ("bf16", torch.bfloat16, 2)):
        a = layer_inputs(B, sdt, seed=B + es)
        ref = layer_reference(a)
        cases = {f"warp_k_layer_{dt}_l{lv}_w{w}": (lambda lv=lv, w=w, **x: warp_k_layer(**x, LANES_V=lv, WARPS=w))
                 for lv, w in LAYER_VARIANTS}
        cases[f"shipped_layer_{dt}"] = kda_layer_decode_launch
        for name, fn in cases.items():
            time_layer_variant(row, name, fn, a, ref, B, es)
    return row


def main() -> int:
    return part_main(__doc__, "kda_decode_warp_k", {"bare": bare_row, "layer": layer_row})


if __name__ == "__main__":
    raise SystemExit(main())
