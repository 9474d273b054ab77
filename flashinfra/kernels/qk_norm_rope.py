"""The vision tower's attention prologue: per-head q/k RMSNorm, axial RoPE and the attention layout, fused.

``qk_norm_rope_ref`` is the tower's own arithmetic (``model.vision``): each head of q and k normalised in
float32, cast back, scaled by its weight (rounded), then rotated in float32 by ``cos``/``sin`` and cast back.
The kernel reads the qkv GEMM output ``[N, 3, H, hd]`` once and writes q, k (normalised and rotated) and v in
the layout the caller asks for through ``L``: token ``n`` of a frame batch lands at ``[n // L, h, n % L]``
of ``[N / L, H, L, hd]`` outputs (``scaled_dot_product_attention``'s layout, no transpose copy): frames of
one size ``L``. Frames of mixed sizes take the reference.

Rounds where the reference rounds, so bf16 results match it to an ulp and float32 results to rounding order.
What it leaves out: the rotary tables (``VisionTower`` keeps them per frame shape) and the attention itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import cdiv, fast

BT = 16  # tokens per program


def qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, eps: float):
    """qkv [N, 3, H, hd] -> q, k, v [N, H, hd]; cos/sin [N, hd] float32."""
    q, k, v = qkv.unbind(1)

    def norm_rope(x, w):
        dtype = x.dtype
        xf = x.float()
        x = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]).to(dtype)

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v


@triton.jit
def _norm_rope(p_x, rows, o_c, HALF, m, w, cs_rows, cos, sin, eps, out_dtype):
    b_lo = tl.load(p_x + rows + o_c[None, :], mask=m, other=0.0).to(tl.float32)  # [BT, hd/2]
    b_hi = tl.load(p_x + rows + HALF + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    b_r = tl.rsqrt((tl.sum(b_lo * b_lo, 1) + tl.sum(b_hi * b_hi, 1)) / (2 * HALF) + eps)
    # the reference rounds the normalised head, then its product with the weight
    b_wl = tl.load(w + o_c).to(tl.float32)
    b_wh = tl.load(w + HALF + o_c).to(tl.float32)
    b_lo = (b_wl[None, :] * (b_lo * b_r[:, None]).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
    b_hi = (b_wh[None, :] * (b_hi * b_r[:, None]).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
    b_cl = tl.load(cos + cs_rows + o_c[None, :], mask=m, other=0.0)
    b_ch = tl.load(cos + cs_rows + HALF + o_c[None, :], mask=m, other=0.0)
    b_sl = tl.load(sin + cs_rows + o_c[None, :], mask=m, other=0.0)
    b_sh = tl.load(sin + cs_rows + HALF + o_c[None, :], mask=m, other=0.0)
    return (b_lo * b_cl - b_hi * b_sl).to(out_dtype), (b_hi * b_ch + b_lo * b_sh).to(out_dtype)


@triton.jit
def qk_norm_rope_kernel(qkv, q_w, k_w, cos, sin, q, k, v, N, L, stride_s, stride_h, stride_l, eps,
                        H: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = tl.arange(0, HALF)
    m = (o_t < N)[:, None] & (o_c < HALF)[None, :]
    o_n = o_t.to(tl.int64)
    rows = (o_n * (3 * H) + i_h)[:, None] * (2 * HALF)  # [BT, 1] offset of head i_h of q in each qkv row
    cs_rows = o_n[:, None] * (2 * HALF)
    out = ((o_n // L) * stride_s + i_h * stride_h + (o_n % L) * stride_l)[:, None]
    ty = q.dtype.element_ty
    b_ql, b_qh = _norm_rope(qkv, rows, o_c, HALF, m, q_w, cs_rows, cos, sin, eps, ty)
    tl.store(q + out + o_c[None, :], b_ql, mask=m)
    tl.store(q + out + HALF + o_c[None, :], b_qh, mask=m)
    b_kl, b_kh = _norm_rope(qkv + H * 2 * HALF, rows, o_c, HALF, m, k_w, cs_rows, cos, sin, eps, ty)
    tl.store(k + out + o_c[None, :], b_kl, mask=m)
    tl.store(k + out + HALF + o_c[None, :], b_kh, mask=m)
    p_v = qkv + 2 * H * 2 * HALF + rows
    tl.store(v + out + o_c[None, :], tl.load(p_v + o_c[None, :], mask=m), mask=m)
    tl.store(v + out + HALF + o_c[None, :], tl.load(p_v + HALF + o_c[None, :], mask=m), mask=m)


def qk_norm_rope_launch(qkv, q_weight, k_weight, cos, sin, eps: float, L: int, outs=None):
    """qkv [N, 3, H, hd] contiguous -> q, k, v [N / L, H, L, hd] (``scaled_dot_product_attention``'s layout).
    ``outs``: three such tensors to write into (the checks poison them)."""
    N, three, H, hd = qkv.shape
    if three != 3 or not qkv.is_contiguous() or N % L or hd % 2 or hd & (hd - 1):
        raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)} (contiguous, hd a power of 2) in frames of {L}")
    if cos.dtype != torch.float32 or cos.shape != (N, hd) or sin.shape != (N, hd):
        raise ValueError(f"qk_norm_rope: cos/sin must be float32 [{N}, {hd}]")
    shape = (N // L, H, L, hd)
    outs = outs or tuple(torch.empty(shape, dtype=qkv.dtype, device=qkv.device) for _ in range(3))
    for o in outs:
        if o.shape != shape or o.dtype != qkv.dtype or not o.is_contiguous():
            raise ValueError(f"qk_norm_rope: outputs must be contiguous {shape} {qkv.dtype}")
    if N:
        fast(qk_norm_rope_kernel)[(cdiv(N, BT), H)](
            qkv, q_weight, k_weight, cos.contiguous(), sin.contiguous(), *outs, N, L, H * L * hd, L * hd, hd, eps,
            H=H, HALF=hd // 2, BT=BT, num_warps=2)
    return outs
