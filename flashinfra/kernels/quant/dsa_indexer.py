"""DSA indexer selection over an fp8 indexer cache: e4m3 entries with per-token scales for the key and the gate
score halves (``[blocks, bs, 2]`` float32), as DeepSeek's indexer caches keys.

``dsa_indexer``'s selection with the pool compression reading the 8-bit cache: ``pool_keys_quant_kernel`` is
``pool_keys_kernel`` with each entry dequantized on load and rounded to the query dtype, which is what the
reference sees (``flashinfra.quant.cache.read_index_entries`` dequantizes into the model dtype before
``Indexer.select``). Scoring, top-k and the tail are ``dsa_indexer``'s (``index_score_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dsa_indexer import index_score_kernel
from flashinfra.kernels.launch import fast


@triton.jit
def pool_keys_quant_kernel(cache, scale, block_tables, seq_lens, ape, out, W, P, stride_cb, KP: tl.constexpr,
                           BS: tl.constexpr, DI: tl.constexpr, BP: tl.constexpr):
    i_b, i_p = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BP + tl.arange(0, BP)
    o_d = tl.arange(0, DI)
    n_pools = tl.load(seq_lens + i_b) // KP
    m_p = o_p < n_pools
    if i_p * BP >= n_pools:
        return
    dt = out.dtype.element_ty
    m = tl.full([BP, DI], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(KP):
        pos = o_p * KP + j
        blk = tl.load(block_tables + i_b * W + pos // BS, mask=m_p, other=0).to(tl.int64)
        row = blk * BS + pos % BS
        g = tl.load(cache + row[:, None] * stride_cb + DI + o_d[None, :], mask=m_p[:, None], other=0.0).to(tl.float32)
        g = (g * tl.load(scale + row * 2 + 1, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
        m = tl.maximum(m, g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :])
    den = tl.zeros([BP, DI], dtype=tl.float32)
    for j in tl.static_range(KP):
        pos = o_p * KP + j
        blk = tl.load(block_tables + i_b * W + pos // BS, mask=m_p, other=0).to(tl.int64)
        row = blk * BS + pos % BS
        g = tl.load(cache + row[:, None] * stride_cb + DI + o_d[None, :], mask=m_p[:, None], other=0.0).to(tl.float32)
        g = (g * tl.load(scale + row * 2 + 1, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
        den += tl.exp(g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :] - m)
    acc = tl.zeros([BP, DI], dtype=tl.float32)
    for j in tl.static_range(KP):
        pos = o_p * KP + j
        blk = tl.load(block_tables + i_b * W + pos // BS, mask=m_p, other=0).to(tl.int64)
        row = blk * BS + pos % BS
        p_row = cache + row[:, None] * stride_cb + o_d[None, :]
        g = tl.load(p_row + DI, mask=m_p[:, None], other=0.0).to(tl.float32)
        g = (g * tl.load(scale + row * 2 + 1, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
        k = tl.load(p_row, mask=m_p[:, None], other=0.0).to(tl.float32)
        k = (k * tl.load(scale + row * 2, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
        prob = (tl.exp(g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :] - m) / den).to(dt).to(tl.float32)
        acc += (prob * k).to(dt).to(tl.float32)  # the reference multiplies in the model dtype, sums in float32
    tl.store(out + (i_b * P + o_p[:, None]).to(tl.int64) * DI + o_d[None, :], acc.to(dt), mask=m_p[:, None])


def dsa_select_quant(
    cache: torch.Tensor,  # [num_blocks, block_size, 2 Di] e4m3 key | gate score, new tokens already written
    scale: torch.Tensor,  # [num_blocks, block_size, 2] float32: the key's and the gate score's scales
    q: torch.Tensor,  # [T, Hi, Di]
    head_weights: torch.Tensor,  # [T, Hi] float32
    ape: torch.Tensor,  # [kpool, Di]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32
    token_seq: torch.Tensor,  # [T] int32
    positions: torch.Tensor,  # [T] int32
    kpool: int,
    topk: int,
    keep_tail: bool,
) -> torch.Tensor:  # [T, k * kpool + tail] int32 positions to attend to, -1 = none
    T, Hi, Di = q.shape
    B, W = block_tables.shape
    bs = cache.shape[1]
    if cache.shape[2] != 2 * Di or scale.shape != (*cache.shape[:2], 2) or ape.shape != (kpool, Di):
        raise ValueError(f"dsa_select_quant: cache {tuple(cache.shape)}, scale {tuple(scale.shape)}, ape "
                         f"{tuple(ape.shape)} do not fit queries {tuple(q.shape)}")
    if Hi & (Hi - 1) or Di & (Di - 1) or Hi < 16 or Di < 16:
        raise ValueError(f"dsa_select_quant: the Triton path needs power-of-two heads and head dim >= 16, got {Hi}x{Di}")
    P = W * bs // kpool
    dev = q.device
    tail = kpool - 1 if keep_tail and kpool > 1 else 0
    k = min(topk // kpool, P)
    pos = positions.long()
    parts = []
    if k > 0 and T > 0:
        pool_keys = torch.empty(B, P, Di, dtype=q.dtype, device=dev)
        BP = 16
        fast(pool_keys_quant_kernel)[(B, triton.cdiv(P, BP))](
            cache, scale.contiguous(), block_tables, seq_lens, ape.contiguous(), pool_keys, W, P, cache.stride(1),
            KP=kpool, BS=bs, DI=Di, BP=BP, num_warps=8)
        keys = torch.empty(T, P, dtype=torch.int64, device=dev)
        q = q if q.stride(-1) == 1 and q.stride(-2) == Di else q.contiguous()
        w = head_weights.float().contiguous()
        BP = 64
        fast(index_score_kernel)[(T, triton.cdiv(P, BP))](
            q, w, pool_keys, token_seq, positions, keys, P, Di**-0.5, q.stride(0), w.stride(0), KP=kpool, HI=Hi,
            DI=Di, BP=BP, IEEE=q.dtype == torch.float32, num_warps=4)
        pools = (torch.topk(keys, k, dim=1).values & 0xFFFFFFFF)  # [T, k]
        toks = pools[:, :, None] * kpool + torch.arange(kpool, device=dev)
        seen = (pools * kpool + kpool - 1 <= pos[:, None])[:, :, None]
        parts.append(torch.where(seen, toks, -1).flatten(1))
    if tail:
        start = pos + 1 - (pos + 1) % kpool
        toks = start[:, None] + torch.arange(tail, device=dev)
        parts.append(torch.where(toks <= pos[:, None], toks, -1))
    if not parts:
        return torch.full((T, 1), -1, dtype=torch.int32, device=dev)
    return torch.cat(parts, dim=1).to(torch.int32)
