"""8-bit linear: int8 (W8A8) or e4m3 (block FP8) weights times activations quantized at run time, on 8-bit tensor
cores. One kernel; the weight format (``WEIGHTS``) is a constexpr read from the weight's dtype.

- ``int8``: ``y = (q_x @ q_w^T) * s_x[:, None] * s_w[None, :] (+ bias)``. Weights int8 ``[N, K]`` with one float32
  scale per output channel, activations one scale per token. The product accumulates in int32 (exact) and the
  scales are applied once, in the epilogue, in float32.
- ``fp8``: ``y[t, n] = sum_kb (q_x[t, kb] . q_w[n, kb]) * s_x[t, kb] * s_w[n // 128, kb]``. Weights e4m3 with one
  scale per 128 x 128 tile, activations one scale per token per 128 channels; each ``BK = 128`` step's float32
  partial product is scaled by its activation and weight block scales before it is accumulated (the DeepSeek-V3
  recipe), so the block scales never meet inside one tensor-core product. Hopper (sm_89+) runs it; older GPUs
  are refused by the caller (``flashinfra.quant.model``).

Activations are quantized by ``act.quant_act`` (a small kernel before the GEMM: a token's scale needs its whole
row, which a GEMM program that sees ``BK`` columns at a time does not have), or, for W8A8 rows that an RMSNorm
produces, in the norm's epilogue (``norm_act.rms_norm_int8``), whose codes ``matmul_8bit`` takes as they are.
``matmul_8bit_ref`` is the same quantized arithmetic in float64 (int32 sums and e4m3 products are exact there);
``linear_8bit_ref`` adds the activation quantization reference in front. Float weights never come here: they run
``kernels.batch_invariant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, pdl_wait
from flashinfra.kernels.quant.act import GROUP, WEIGHT_FORMATS, quant_act, quant_act_ref


def matmul_8bit_ref(xq, sx, wq, sw, bias=None, block=(GROUP, GROUP), out_dtype=torch.float32):
    """int8: xq [T, K], sx [T], wq [N, K], sw [N]; e4m3: xq [T, K], sx [T, ceil(K/bk)], wq [N, K],
    sw [ceil(N/bn), ceil(K/bk)] -> [T, N] in ``out_dtype`` (computed in float64)."""
    if WEIGHT_FORMATS[wq.dtype] == "int8":
        y = (xq.double() @ wq.double().t()) * sx.double()[:, None] * sw.double()[None, :]
    else:
        bn, bk = block
        N, K = wq.shape
        x = xq.double() * sx.double().repeat_interleave(bk, dim=1)[:, :K]
        w = wq.double() * sw.double().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
        y = x @ w.t()
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def linear_8bit_ref(x, wq, sw, bias=None, block=(GROUP, GROUP)):
    xq, sx = quant_act_ref(WEIGHT_FORMATS[wq.dtype], x.reshape(-1, x.shape[-1]), block[1])
    return matmul_8bit_ref(xq, sx, wq, sw, bias, block, x.dtype).view(*x.shape[:-1], wq.shape[0])


@triton.jit
def fp8_step(prod, s_rows, p_sw, m_n, ONE_BLOCK: tl.constexpr):
    """An FP8 K step's product scaled by its rows' activation scales ``s_rows`` and the weight block scales at
    ``p_sw``: for a column tile inside one weight block (``ONE_BLOCK``, ``p_sw`` one pointer) one scale, folded into
    the rows' (a multiply-add per element as it is accumulated); else one per column (``p_sw`` a pointer a column)."""
    if ONE_BLOCK:
        scaled = prod * (s_rows * tl.load(p_sw))[:, None]
    else:
        scaled = prod * s_rows[:, None] * tl.load(p_sw, mask=m_n, other=0.0)[None, :]
    return scaled


@triton.jit
def matmul_8bit_kernel(xq, sx, wq, sw, bias, y, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WEIGHTS: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    p_x = xq + o_m[:, None].to(tl.int64) * K
    p_w = wq + o_n[None, :].to(tl.int64) * K
    if WEIGHTS == "int8":  # exact int32 sums, scaled once in the epilogue
        acc = tl.zeros([BM, BN], dtype=tl.int32)
    else:  # fp8: scales [M, KB] and [ceil(N / BLOCK_N), KB] (``fp8_step``)
        KB = tl.cdiv(K, BK)
        ONE_BLOCK: tl.constexpr = BLOCK_N % BN == 0
        p_sx = sx + o_m.to(tl.int64) * KB
        p_sw = sw + ((i_n * BN if ONE_BLOCK else o_n) // BLOCK_N).to(tl.int64) * KB
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(p_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if WEIGHTS == "int8":
            acc += tl.dot(b_x, b_w)
        else:
            acc += fp8_step(tl.dot(b_x, b_w), tl.load(p_sx + k0 // BK, mask=m_m, other=0.0), p_sw + k0 // BK, m_n,
                            ONE_BLOCK)
    if WEIGHTS == "int8":
        b_sx = tl.load(sx + o_m, mask=m_m, other=0.0)
        b_sw = tl.load(sw + o_n, mask=m_n, other=0.0)
        acc = acc.to(tl.float32) * b_sx[:, None] * b_sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y + o_m[:, None].to(tl.int64) * N + o_n[None, :], acc.to(y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


# Programs a decode GEMM's output columns should at least make, about one an SM: fewer leave SMs without a share of
# the weight stream (an output 4,096 wide in 64-column tiles is 64 programs).
DECODE_PROGRAMS = 128


def _config(M: int, N: int, fmt: str) -> dict:
    """Thin M tiles for decode (the weight stream is the cost), square ones for prefill; fp8 steps through K by
    its scales' block. An int8 decode GEMM narrows its column tiles until they make ``DECODE_PROGRAMS``, each then
    streaming longer K steps deeper; an fp8 one takes 32 columns, deeper where 64 would make too few programs
    (``notes/quant.md``: decode tiles measured)."""
    if M <= 16:
        if fmt != "int8":
            return dict(BM=16, BN=32, BK=GROUP, num_warps=4, num_stages=6 if cdiv(N, 64) < DECODE_PROGRAMS else 4)
        BN = 64
        while BN > 16 and cdiv(N, BN) < DECODE_PROGRAMS:
            BN //= 2
        return dict(BM=16, BN=BN, BK=256 if BN == 64 else 512, num_warps=4, num_stages=4 if BN == 64 else 6)
    if M <= 64:
        return dict(BM=64, BN=64, BK=GROUP, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, BK=GROUP, num_warps=8, num_stages=3)


def _check(fmt, xq, sx, wq, sw, block):
    M, K = xq.shape
    N = wq.shape[0]
    bn, bk = block
    if fmt == "int8":
        fits = sx.shape == (M,) and sw.shape == (N,)
    else:
        KB = cdiv(K, bk)
        fits = bk == GROUP and sx.shape == (M, KB) and sw.shape == (cdiv(N, bn), KB)
    if wq.shape != (N, K) or not fits:
        raise ValueError(f"matmul_8bit: {fmt} x {tuple(xq.shape)} / scale {tuple(sx.shape)} and w {tuple(wq.shape)} "
                         f"/ scale {tuple(sw.shape)} do not fit" + (f" blocks {block}" if fmt == "fp8" else ""))
    if not all(t.is_contiguous() for t in (xq, sx, wq, sw)):
        raise ValueError("matmul_8bit: operands and scales must be contiguous")


def matmul_8bit_launch(xq, sx, wq, sw, bias=None, block=(GROUP, GROUP), out_dtype=torch.bfloat16):
    fmt = WEIGHT_FORMATS[wq.dtype]
    _check(fmt, xq, sx, wq, sw, block)
    M, K = xq.shape
    N = wq.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    if M == 0:
        return y
    cfg = _config(M, N, fmt)
    grid = (cdiv(M, cfg["BM"]), cdiv(N, cfg["BN"]))
    fast(matmul_8bit_kernel)[grid](xq, sx, wq, sw, bias if bias is not None else sw, y, M, N, K,
                                   HAS_BIAS=bias is not None, BLOCK_N=block[0], BM=cfg["BM"], BN=cfg["BN"],
                                   BK=cfg["BK"], WEIGHTS=fmt, num_warps=cfg["num_warps"],
                                   num_stages=cfg["num_stages"])
    return y


def linear_8bit_launch(x, wq, sw, bias=None, block=(GROUP, GROUP)):
    xq, sx = quant_act(WEIGHT_FORMATS[wq.dtype], x.reshape(-1, x.shape[-1]), block[1])
    return matmul_8bit_launch(xq, sx, wq, sw, bias, block, x.dtype).view(*x.shape[:-1], wq.shape[0])


def linear_8bit(x, wq, sw, bias=None, block=(GROUP, GROUP)):
    """x [..., K] float; wq int8 [N, K] with sw float32 [N], or e4m3 [N, K] with sw float32
    [ceil(N/bn), ceil(K/bk)] -> [..., N] in x's dtype."""
    if use_triton(x, wq, sw):
        return linear_8bit_launch(x, wq, sw, bias, block)
    return linear_8bit_ref(x, wq, sw, bias, block)


def matmul_8bit(xq, sx, wq, sw, bias=None, block=(GROUP, GROUP), out_dtype=torch.bfloat16):
    """Activations already quantized (``xq`` [T, K] with ``sx``, as ``linear_8bit`` would quantize them) times the
    8-bit weights -> [T, N] in ``out_dtype``."""
    if use_triton(xq, wq, sw):
        return matmul_8bit_launch(xq, sx, wq, sw, bias, block, out_dtype)
    return matmul_8bit_ref(xq, sx, wq, sw, bias, block, out_dtype)
