"""The DSA indexer's new cache entries in one launch: each token's key LayerNorm-ed (``Indexer.entries``' arithmetic:
float32 mean and biased variance, rounded once to the cache's dtype) and its gate score beside it, stored
at the token's slot of the entries cache ``[S, 2 Di]``, from the indexer projection's key | gate columns as they
are. It stands for the norm, the concatenation and the indexed store (three launches) where the cache holds the
model dtype; an e4m3 cache quantizes the formed entries (``quant.cache.write_index_entries``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait


@triton.jit
def entries_write_kernel(kg, w, b, rows, slots, T, DI, stride_kg, eps, BT: tl.constexpr, BD: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < DI
    m = m_t[:, None] & m_d[None, :]
    src = kg + o_t[:, None].to(tl.int64) * stride_kg + o_d[None, :]
    k = tl.load(src, mask=m, other=0.0).to(tl.float32)
    gate = tl.load(src + DI, mask=m, other=0.0)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_b = tl.load(b + o_d, mask=m_d, other=0.0).to(tl.float32)
    slot = tl.load(slots + o_t, mask=m_t, other=-1).to(tl.int64)
    mean = tl.sum(k, 1) / DI
    dev = tl.where(m, k - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(dev * dev, 1) / DI + eps)
    key = dev * rstd[:, None] * b_w[None, :] + b_b[None, :]
    dst = rows + slot[:, None] * (2 * DI) + o_d[None, :]
    keep = m & (slot >= 0)[:, None]
    tl.store(dst, key.to(rows.dtype.element_ty), mask=keep)
    tl.store(dst + DI, gate.to(rows.dtype.element_ty), mask=keep)


def write_entries_launch(kg: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, rows: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """``kg`` [T, 2 Di] key | gate score (rows of unit column stride), the key norm's ``weight``, ``bias`` [Di] and
    ``eps`` -> the entries stored at ``slots`` [T] (negative: none) of ``rows`` [S, 2 Di] (contiguous)."""
    T, Di = kg.shape[0], weight.shape[0]
    if (kg.shape != (T, 2 * Di) or kg.stride(-1) != 1 or bias.shape != (Di,) or rows.dim() != 2
            or rows.shape[1] != 2 * Di or not rows.is_contiguous() or slots.shape != (T,)):
        raise ValueError(f"write_entries: key | gate {tuple(kg.shape)}, norm {tuple(weight.shape)}, cache rows "
                         f"{tuple(rows.shape)} and slots {tuple(slots.shape)} do not fit")
    if T:
        BT = 8
        fast(entries_write_kernel)[(cdiv(T, BT),)](kg, weight, bias, rows, slots.contiguous(), T, Di, kg.stride(0),
                                                   float(eps), BT=BT, BD=next_power_of_2(Di), num_warps=4)
