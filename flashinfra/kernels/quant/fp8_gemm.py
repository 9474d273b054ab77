"""Block-FP8 linear: e4m3 weights with one scale per 128 x 128 tile, e4m3 activations with one scale per token
per 128 channels, products on FP8 tensor cores.

``y[t, n] = sum_kb (q_x[t, kb] . q_w[n, kb]) * s_x[t, kb] * s_w[n // 128, kb]``: each ``BK = 128`` step's
float32 partial product is scaled by its activation and weight block scales before it is accumulated (the
DeepSeek-V3 recipe), so the block scales never meet inside one tensor-core product.

``fp8_matmul_ref`` is the same arithmetic in float64 (e4m3 products are exact there); ``fp8_block_linear_ref``
adds the activation quantization reference in front. Hopper (sm_89+) runs the kernel; older GPUs are refused
by the caller (``flashinfra.quant.model``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import fast
from flashinfra.kernels.quant.act import quant_fp8_per_group, quant_fp8_per_group_ref

GROUP = 128


def fp8_matmul_ref(xq, sx, wq, sw, block=(GROUP, GROUP), bias=None, out_dtype=torch.float32):
    """xq e4m3 [T, K], sx [T, ceil(K/bk)], wq e4m3 [N, K], sw [ceil(N/bn), ceil(K/bk)] -> [T, N] (float64 math)."""
    bn, bk = block
    N, K = wq.shape
    x = xq.double() * sx.double().repeat_interleave(bk, dim=1)[:, :K]
    w = wq.double() * sw.double().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    y = x @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def fp8_block_linear_ref(x, wq, sw, block=(GROUP, GROUP), bias=None):
    xq, sx = quant_fp8_per_group_ref(x.reshape(-1, x.shape[-1]), block[1])
    return fp8_matmul_ref(xq, sx, wq, sw, block, bias, x.dtype).view(*x.shape[:-1], wq.shape[0])


@triton.jit
def fp8_matmul_kernel(xq, sx, wq, sw, bias, y, M, N, K, KB, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    p_x = xq + o_m[:, None].to(tl.int64) * K
    p_w = wq + o_n[None, :].to(tl.int64) * K
    p_sx = sx + o_m.to(tl.int64) * KB
    p_sw = sw + (o_n // BLOCK_N).to(tl.int64) * KB
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, KB):
        o_k = kb * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_sx = tl.load(p_sx + kb, mask=m_m, other=0.0)
        b_sw = tl.load(p_sw + kb, mask=m_n, other=0.0)
        acc += tl.dot(b_x, b_w) * b_sx[:, None] * b_sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y + o_m[:, None].to(tl.int64) * N + o_n[None, :], acc.to(y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def _config(M: int) -> dict:
    if M <= 16:
        return dict(BM=16, BN=64, num_warps=4, num_stages=4)
    if M <= 64:
        return dict(BM=64, BN=64, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, num_warps=8, num_stages=3)


def fp8_matmul_launch(xq, sx, wq, sw, block=(GROUP, GROUP), bias=None, out_dtype=torch.bfloat16):
    M, K = xq.shape
    N = wq.shape[0]
    bn, bk = block
    KB = triton.cdiv(K, bk)
    if bk != GROUP or wq.shape != (N, K) or sx.shape != (M, KB) or sw.shape != (triton.cdiv(N, bn), KB):
        raise ValueError(f"fp8_matmul: x {tuple(xq.shape)} / scale {tuple(sx.shape)} and w {tuple(wq.shape)} / "
                         f"scale {tuple(sw.shape)} do not fit blocks {block}")
    if not (xq.is_contiguous() and wq.is_contiguous() and sx.is_contiguous() and sw.is_contiguous()):
        raise ValueError("fp8_matmul: operands and scales must be contiguous")
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    cfg = _config(M)
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]))
    fast(fp8_matmul_kernel)[grid](xq, sx, wq, sw, bias if bias is not None else sw, y, M, N, K, KB,
                                  HAS_BIAS=bias is not None, BLOCK_N=bn, BM=cfg["BM"], BN=cfg["BN"], BK=bk,
                                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def fp8_block_linear_launch(x, wq, sw, block=(GROUP, GROUP), bias=None):
    xq, sx = quant_fp8_per_group(x.reshape(-1, x.shape[-1]), block[1])
    return fp8_matmul_launch(xq, sx, wq, sw, block, bias, x.dtype).view(*x.shape[:-1], wq.shape[0])


def fp8_block_linear(x, wq, sw, block=(GROUP, GROUP), bias=None):
    """x [..., K] float, wq e4m3 [N, K], sw float32 [ceil(N/128), ceil(K/128)] -> [..., N] in x's dtype."""
    if use_triton(x, wq, sw):
        return fp8_block_linear_launch(x, wq, sw, block, bias)
    return fp8_block_linear_ref(x, wq, sw, block, bias)
