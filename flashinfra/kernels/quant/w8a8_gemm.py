"""W8A8 INT8 linear: ``y = (q_x @ q_w^T) * s_x[:, None] * s_w[None, :] (+ bias)`` on int8 tensor cores.

Weights are int8 ``[N, K]`` with one float32 scale per output channel; activations are quantized per token at
run time by ``act.quant_int8_per_token`` (a small kernel before the GEMM: a token's scale needs its whole
row, which a GEMM program that sees ``BK`` columns at a time does not have). The product accumulates in int32
(exact) and the scales are applied once, in the epilogue, in float32.

``w8a8_matmul_ref`` is the same quantized arithmetic in float64 (the int32 sums are exact there too);
``w8a8_linear_ref`` adds the activation quantization reference in front.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import fast
from flashinfra.kernels.quant.act import quant_int8_per_token, quant_int8_per_token_ref


def w8a8_matmul_ref(xq, sx, wq, sw, bias=None, out_dtype=torch.float32):
    """xq int8 [T, K], sx [T], wq int8 [N, K], sw [N] -> [T, N] in ``out_dtype`` (computed in float64)."""
    acc = xq.double() @ wq.double().t()
    y = acc * sx.double()[:, None] * sw.double()[None, :]
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def w8a8_linear_ref(x, wq, sw, bias=None):
    xq, sx = quant_int8_per_token_ref(x.reshape(-1, x.shape[-1]))
    return w8a8_matmul_ref(xq, sx, wq, sw, bias, x.dtype).view(*x.shape[:-1], wq.shape[0])


@triton.jit
def w8a8_matmul_kernel(xq, sx, wq, sw, bias, y, M, N, K, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    p_x = xq + o_m[:, None].to(tl.int64) * K
    p_w = wq + o_n[None, :].to(tl.int64) * K
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0)
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0)
        acc += tl.dot(b_x, b_w)
    b_sx = tl.load(sx + o_m, mask=m_m, other=0.0)
    b_sw = tl.load(sw + o_n, mask=m_n, other=0.0)
    out = acc.to(tl.float32) * b_sx[:, None] * b_sw[None, :]
    if HAS_BIAS:
        out += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y + o_m[:, None].to(tl.int64) * N + o_n[None, :], out.to(y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def _config(M: int) -> dict:
    """Thin M tiles for decode (the weight stream is the cost), square ones for prefill."""
    if M <= 16:
        return dict(BM=16, BN=64, BK=256, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=3)


def w8a8_matmul_launch(xq, sx, wq, sw, bias=None, out_dtype=torch.bfloat16):
    M, K = xq.shape
    N = wq.shape[0]
    if wq.shape != (N, K) or sw.shape != (N,) or sx.shape != (M,):
        raise ValueError(f"w8a8_matmul: x {tuple(xq.shape)} / scale {tuple(sx.shape)} and w {tuple(wq.shape)} / "
                         f"scale {tuple(sw.shape)} do not fit")
    if not (xq.is_contiguous() and wq.is_contiguous()):
        raise ValueError("w8a8_matmul: int8 operands must be contiguous")
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    cfg = _config(M)
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]))
    fast(w8a8_matmul_kernel)[grid](xq, sx, wq, sw, bias if bias is not None else sw, y, M, N, K,
                                   HAS_BIAS=bias is not None, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def w8a8_linear_launch(x, wq, sw, bias=None):
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quant_int8_per_token(x2)
    return w8a8_matmul_launch(xq, sx, wq, sw, bias, x.dtype).view(*x.shape[:-1], wq.shape[0])


def w8a8_linear(x, wq, sw, bias=None):
    """x [..., K] float, wq int8 [N, K], sw float32 [N] -> [..., N] in x's dtype."""
    if use_triton(x, wq, sw):
        return w8a8_linear_launch(x, wq, sw, bias)
    return w8a8_linear_ref(x, wq, sw, bias)
