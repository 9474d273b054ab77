"""The bare bf16-state decode step with its two sums over K as tensor-core products, against the shipped kernel and
flash-linear-attention's fused_recurrent_kda in the same run. CUDA graph, H=64, K=V=128.

Why (bench/notes/kda_decode.md, "The bf16 bare step's instructions by source line"): in the shipped bf16 program
the two reductions over K (``k^T S`` after the decay, ``q^T S'`` for the output) take 353 of its 944 instructions per
thread, and its time follows its instructions. A bf16 state block is exact as loaded, so both sums can run on the
tensor cores without rounding the state: ``k_n^T (d S) = (k_n d)^T S`` and ``q_n^T S' = (q_n d)^T S + (q_n . k_n)
delta``, where d = exp(g) per row and S' = d S + k_n delta^T. The vectors ``k_n d`` and ``q_n d`` enter as three
bf16 parts each (hi, mid, lo: about 24 bits, a float32's precision). The six parts are the rows of one [16, K]
operand, whose other rows are zero: a product [16, K] x [K, BV] on ``mma.sync`` (the tensor cores idle otherwise),
accumulated in float32. The new block is formed in float32 and rounded once, as shipped.

Each variant is first checked against a float64 step (output poisoned, the bf16 state updated in place through
random slots), then timed.

    python bench/kda_decode_dot_sums.py [--part bare|layer] [--batches 64,256] [--out DIR]
        -> bench/results/kda_decode_dot_sums.json, kda_decode_dot_sums_layer.json

``--part layer``: the bf16 layer (bench/kda_decode.py's inputs) with the same step in its "tiles" state kernel
(``kda_layer_tile_dot_kernel`` in the shipped kernel's place), at the default configuration and as one [K, V] tile
per head on 8 warps (the gated norm in the state kernel), against the shipped layer; each checked against
``kda_layer_decode_ref`` in float64 first.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import part_main, relerr, time_graph  # noqa: E402

from flashinfra import env  # noqa: E402
from flashinfra.kernels.kda_decode import kda_decode_launch, kda_decode_ref  # noqa: E402
from flashinfra.kernels import kda_layer_decode_stream as stream  # noqa: E402
from flashinfra.kernels.kda_layer_decode import kda_layer_decode_launch  # noqa: E402
from flashinfra.kernels.kda_layer_decode_parts import load_state, state_tile  # noqa: E402
from flashinfra.kernels.kda_prefill_intra64_split import mma_bf16  # noqa: E402

H, K, V = 64, 128, 128
# (BV, warps) of the variants timed
VARIANTS = [(64, 4), (32, 2), (128, 8), (64, 8), (32, 4)]


@triton.jit
def _parts3(x):
    """x (float32) as three bf16 parts whose sum carries about 24 bits of it."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    return hi, mid, (r - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_step(b_s, b_q, b_k, b_d, b_beta, b_v, BV: tl.constexpr, DOT_F32: tl.constexpr):
    """The step on a bf16 [K, BV] block as loaded (exact), q scaled and normalised, k normalised, d = exp(g): the new
    block in float32 and the [BV] output. Both sums over K come from one [16, K] x [K, BV] product."""
    qk = tl.sum(b_q * b_k)
    kh, km, kl = _parts3(b_k * b_d)
    qh, qm, ql = _parts3(b_q * b_d)
    r = tl.arange(0, 16)[:, None]
    a = tl.where(r == 0, kh[None, :], tl.where(r == 1, km[None, :], tl.where(r == 2, kl[None, :],
                                                                             tl.zeros_like(kh)[None, :])))
    a = tl.where(r == 3, qh[None, :], tl.where(r == 4, qm[None, :], tl.where(r == 5, ql[None, :], a)))
    # [16, BV] float32: rows 0-2 the parts of k_n^T (d S), rows 3-5 those of q_n^T (d S)
    p = mma_bf16(a, b_s, tl.zeros([16, BV], dtype=tl.float32), DOT_F32)
    ks = tl.sum(tl.where(r < 3, p, 0.0), 0)
    qs = tl.sum(tl.where((r >= 3) & (r < 6), p, 0.0), 0)
    b_delta = (b_v - ks) * b_beta
    return b_s.to(tl.float32) * b_d[:, None] + b_k[:, None] * b_delta[None, :], qs + qk * b_delta


@triton.jit
def kda_decode_dot_kernel(
    q, k, v, g, beta, o, state, state_slots, stride_q_b, stride_q_h, stride_k_b, stride_k_h, stride_v_b, stride_v_h,
    scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Grid (V / BV, B * H), a bf16 state: ``kda_decode_kernel``'s step with both sums over K from one [16, K] x
    [K, BV] product on the block as loaded (K and V multiples of the block: no masks)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_slots + i_b).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_s = state + (slot * H + i_h) * (K * V) + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(p_s, eviction_policy="evict_last")  # [K, BV] bf16, exact
    b_q = tl.load(q + i_b * stride_q_b + i_h * stride_q_h + o_k).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_b + i_h * stride_k_h + o_k).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v_b + i_h * stride_v_h + o_v).to(tl.float32)
    b_d = tl.exp(tl.load(g + i_bh * K + o_k).to(tl.float32))
    b_beta = tl.load(beta + i_bh).to(tl.float32)
    b_q = b_q * (scale / tl.sqrt(tl.sum(b_q * b_q) + 1e-6))
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_s, b_o = _dot_step(b_s, b_q, b_k, b_d, b_beta, b_v, BV, DOT_F32)
    tl.store(p_s, b_s.to(state.dtype.element_ty))
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty))


@triton.jit
def kda_layer_tile_dot_kernel(
    state, heads, state_slots, out, gate, norm_w, eps, stride_gate,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr,
    NORM: tl.constexpr, DOT_F32: tl.constexpr = False,
):
    """``kda_layer_decode_tile_kernel`` (kda_layer_decode_stream.py, the layer's bf16 state kernel above B=32)
    with ``_dot_step``: same arguments, so ``layer_with_dot_tiles`` puts it in that kernel's place."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_s, m_s = state_tile(state, tl.load(state_slots + i_bh // H).to(tl.int64), i_bh % H, o_k, o_v, H, K, V)
    b_s = load_state(p_s, m_s)  # bf16 as loaded: exact
    b_q, b_k, b_decay, b_v, b_beta = stream._head_rows(heads, i_bh, o_k, o_v, R)
    b_s, b_o = _dot_step(b_s, b_q, b_k, b_decay, b_beta, b_v, BV, DOT_F32)
    if NORM:
        b_o = stream._gated_norm_row(b_o, gate + (i_bh // H) * stride_gate + (i_bh % H) * V, norm_w, eps, o_v, m_v,
                                     V, out.dtype.element_ty)
    tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)


class layer_with_dot_tiles:
    """Within the block: the layer's "tiles" state kernel is ``kda_layer_tile_dot_kernel`` (a bf16 state only)."""

    def __enter__(self):
        self.saved = stream.kda_layer_decode_tile_kernel
        dot_f32 = env.triton_interpret()
        stream.kda_layer_decode_tile_kernel = _Bound(kda_layer_tile_dot_kernel, DOT_F32=dot_f32)
        return self

    def __exit__(self, *exc):
        stream.kda_layer_decode_tile_kernel = self.saved


class _Bound:
    """``kernel[grid](...)`` with some constexprs fixed."""

    def __init__(self, kernel, **fixed):
        self.kernel, self.fixed = kernel, fixed

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, **self.fixed)


def dot_launch(q, k, v, g, beta, state, slots, o, BV: int, num_warps: int):
    Bn, Hn, Kn = q.shape
    Vn = v.shape[-1]
    kda_decode_dot_kernel[(Vn // BV, Bn * Hn)](
        q, k, v, g, beta, o, state, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), Kn**-0.5, H=Hn, K=Kn, V=Vn, BV=BV, DOT_F32=env.triton_interpret(), num_warps=num_warps)
    return o


def step_inputs(B: int, Hn: int, Kn: int, Vn: int, device: str, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, Hn, Kn, device=device, generator=gen).bfloat16()
    k = torch.randn(B, Hn, Kn, device=device, generator=gen).bfloat16()
    v = torch.randn(B, Hn, Vn, device=device, generator=gen).bfloat16()
    g = -5 * torch.sigmoid(torch.randn(B, Hn, Kn, device=device, generator=gen))
    beta = torch.rand(B, Hn, device=device, generator=gen)
    slots = torch.randperm(B + 3, device="cpu", generator=torch.Generator().manual_seed(seed))[:B]
    state = (torch.randn(B + 3, Hn, Kn, Vn, device=device, generator=gen) * 0.1).bfloat16()
    return dict(q=q, k=k, v=v, g=g, beta=beta, slots=slots.to(device=device, dtype=torch.int32), state=state)


def check(a: dict, fn) -> tuple[float, float]:
    """Output and new-state errors of ``fn(state, out)`` against one float64 step (kda_decode_ref)."""
    s64 = a["state"].double().clone()
    ref_o = kda_decode_ref(a["q"].double(), a["k"].double(), a["v"].double(), a["g"].double(), a["beta"].double(),
                           s64, a["slots"].long())
    st = a["state"].clone()
    o = torch.full_like(a["v"], float("nan"))
    fn(st, o)
    idx = a["slots"].long()
    untouched = torch.ones(st.shape[0], dtype=torch.bool, device=st.device)
    untouched[idx] = False
    assert torch.equal(st[untouched], a["state"][untouched]), "a slot outside the batch changed"
    return relerr(o, ref_o), relerr(st[idx], s64[idx])


def row(B: int) -> dict:
    a = step_inputs(B, H, K, V, "cuda", seed=B)
    q, k, v, g, beta, slots = (a[n] for n in ("q", "k", "v", "g", "beta", "slots"))
    o = torch.empty_like(v)
    res = {"B": B}
    cases = {f"dot_BV{bv}_w{w}": (lambda st, out, bv=bv, w=w: dot_launch(q, k, v, g, beta, st, slots, out, bv, w))
             for bv, w in VARIANTS}
    cases["shipped_bf16"] = lambda st, out: kda_decode_launch(q, k, v, g, beta, st, slots, out=out)
    for name, fn in cases.items():
        res[name + "_relerr_o"], res[name + "_relerr_state"] = check(a, fn)
        st = a["state"].clone()
        res[name + "_graph_us"] = time_graph(lambda fn=fn, st=st: fn(st, o))
    try:
        from fla.ops.kda import fused_recurrent_kda
        h0 = a["state"][slots.long()].float()
        res["fla_fp32_graph_us"] = time_graph(lambda: fused_recurrent_kda(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.bfloat16().unsqueeze(1),
            scale=K**-0.5, initial_state=h0, output_final_state=True))
    except ImportError as exc:
        res["fla_error"] = repr(exc)
    for key in [n for n in res if n.endswith("_graph_us")]:
        res[key.replace("_graph_us", "_frac_copy")] = B * H * K * V * 2 * 2 / res[key] / 1e3  # GB/s
    return res


def layer_row(B: int) -> dict:
    """The bf16 layer at batch B, shipped and with the dot tiles kernel: at the default configuration, at [K, 64]
    on 4 warps capped at 80 registers (six programs per SM), and as one [K, V] tile per head on 8 warps (the norm
    in the state kernel, two launches); each checked against float64."""
    from kda_decode import layer_inputs, layer_reference, time_layer_variant

    a = layer_inputs(B, torch.bfloat16, seed=B + 2)
    ref = layer_reference(a)
    res = {"B": B}
    shapes = {"default": {}, "tiles_BV64_w4_cap80": dict(grid="tiles", BV=64, num_warps=4, maxnreg=80),
              "tiles_BV128_w8": dict(grid="tiles", BV=128, num_warps=8)}
    for dot in (False, True):
        for shape, launch in shapes.items():
            with layer_with_dot_tiles() if dot else contextlib.nullcontext():
                time_layer_variant(res, ("dot_" if dot else "shipped_") + shape,
                                   lambda launch=launch, **x: kda_layer_decode_launch(**x, **launch), a, ref, B, 2)
    return res


def main() -> int:
    return part_main(__doc__, "kda_decode_dot_sums", {"bare": row, "layer": layer_row})


if __name__ == "__main__":
    raise SystemExit(main())
