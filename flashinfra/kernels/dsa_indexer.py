"""DSA lightning indexer over the paged indexer cache: k-pool compression, scoring, top-k with the tail.

Semantics are ``flashinfra.model.indexer`` (its ``Indexer.select`` is the reference, one sequence at a
time): per complete pool of ``kpool`` cached tokens a compressed key (per channel a softmax over the pool's
tokens of gate score + position bias weights their keys, rounded where the reference rounds); a query
scores each pool with ``sum_h w_h relu(q_h . k_pool / sqrt(d))``, keeps the best ``index_topk / kpool``
pools whose last token it can see (ties to the more recent pool) and always the incomplete tail pool.

The fast path takes tensors only (no per-sequence Python loop, no host sync), so a decode step can be
captured in a CUDA graph:

1. ``pool_keys_kernel``: per (sequence, block of pools) the compressed keys ``[B, P, Di]``, where ``P`` is
   the pool capacity of the (padded) block table, read through the block table.
2. ``index_score_kernel``: per (query token, block of pools) the scores as int64 sort keys: the float
   score's order-preserving bits in the high word and the pool index in the low word, so one
   ``torch.topk`` over distinct keys reproduces the reference's tie rule exactly (a zero score of either
   sign is +0, as the reference's sort sees them equal). Pools the query cannot see get the float32
   minimum, like the reference.
3. ``dsa_select``: top-k and the token list ``[T, k * kpool + kpool - 1]`` (-1 = nothing) that sparse MLA
   attends to: the selected pools' tokens, then the tail (in deterministic mode the tail first, so that each
   position keeps its column whatever the batch's widest block table makes the pools' width).

Cache formats (``FP8``, a constexpr read from the cache's dtype): entries in the model dtype, or e4m3 entries with
one float32 scale per token for the key half and one for the gate score half (``[blocks, bs, 2]``, as DeepSeek's
indexer caches keys). ``pool_keys_kernel`` dequantizes fp8 entries on load and rounds them to the query dtype,
which is what the reference sees (``flashinfra.quant.cache.read_index_entries`` dequantizes into the model dtype
before ``Indexer.select``); scoring, top-k and the tail are the same for both. The scale pointer comes after the
float kernel's arguments, so that the float specialisation keeps its parameter layout (and its machine code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic
from flashinfra.kernels.launch import fast

FMIN = torch.finfo(torch.float32).min


@triton.jit
def _gate_logits(cache, block_tables, ape, scale, i_b, W, o_p, o_d, m_p, stride_cb, j, dt: tl.constexpr,
                 KP: tl.constexpr, BS: tl.constexpr, DI: tl.constexpr, FP8: tl.constexpr):
    """[BP, DI] float32: each pool's entry ``j``'s gate scores plus their position bias (fp8 entries dequantized and
    rounded to ``dt``, as the reference reads them)."""
    pos = o_p * KP + j
    blk = tl.load(block_tables + i_b * W + pos // BS, mask=m_p, other=0).to(tl.int64)
    row = blk * BS + pos % BS
    g = tl.load(cache + row[:, None] * stride_cb + DI + o_d[None, :], mask=m_p[:, None], other=0.0).to(tl.float32)
    if FP8:
        g = (g * tl.load(scale + row * 2 + 1, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
    return g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :]


@triton.jit
def pool_keys_kernel(cache, block_tables, seq_lens, ape, out, W, P, stride_cb, scale, KP: tl.constexpr,
                     BS: tl.constexpr, DI: tl.constexpr, BP: tl.constexpr, FP8: tl.constexpr):
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
        m = tl.maximum(m, _gate_logits(cache, block_tables, ape, scale, i_b, W, o_p, o_d, m_p, stride_cb, j, dt, KP, BS,
                                       DI, FP8))
    den = tl.zeros([BP, DI], dtype=tl.float32)
    for j in tl.static_range(KP):
        den += tl.exp(_gate_logits(cache, block_tables, ape, scale, i_b, W, o_p, o_d, m_p, stride_cb, j, dt, KP, BS, DI,
                                   FP8) - m)
    acc = tl.zeros([BP, DI], dtype=tl.float32)
    for j in tl.static_range(KP):
        pos = o_p * KP + j
        blk = tl.load(block_tables + i_b * W + pos // BS, mask=m_p, other=0).to(tl.int64)
        row = blk * BS + pos % BS
        p_row = cache + row[:, None] * stride_cb + o_d[None, :]
        g = tl.load(p_row + DI, mask=m_p[:, None], other=0.0).to(tl.float32)
        k = tl.load(p_row, mask=m_p[:, None], other=0.0).to(tl.float32)
        if FP8:
            g = (g * tl.load(scale + row * 2 + 1, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
            k = (k * tl.load(scale + row * 2, mask=m_p, other=0.0)[:, None]).to(dt).to(tl.float32)
        prob = (tl.exp(g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :] - m) / den).to(dt).to(tl.float32)
        acc += (prob * k).to(dt).to(tl.float32)  # the reference multiplies in the model dtype, sums in float32
    tl.store(out + (i_b * P + o_p[:, None]).to(tl.int64) * DI + o_d[None, :], acc.to(dt), mask=m_p[:, None])


@triton.jit
def index_score_kernel(q, w, pool_keys, token_seq, positions, out, P, scale, stride_qt, stride_wt,
                       KP: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BP: tl.constexpr, IEEE: tl.constexpr):
    i_t, i_p = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    pos = tl.load(positions + i_t)
    visible = (o_p * KP + KP - 1 <= pos) & m_p
    key_min = (tl.full([BP], -2139095040, tl.int32).to(tl.int64) << 32) | o_p.to(tl.int64)  # float32 min's order bits
    p_out = out + i_t.to(tl.int64) * P + o_p
    if i_p * BP * KP + KP - 1 > pos:  # no pool of this block is visible to the query
        tl.store(p_out, key_min, mask=m_p)
        return
    b = tl.load(token_seq + i_t).to(tl.int64)
    o_h = tl.arange(0, HI)
    o_d = tl.arange(0, DI)
    b_q = tl.load(q + i_t.to(tl.int64) * stride_qt + o_h[:, None] * DI + o_d[None, :])
    b_k = tl.load(pool_keys + (b * P + o_p[:, None]) * DI + o_d[None, :], mask=visible[:, None], other=0.0)
    if IEEE:
        s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)))
    s = tl.maximum(s * scale, 0.0)  # [HI, BP]
    b_w = tl.load(w + i_t * stride_wt + o_h)
    score = tl.sum(b_w[:, None] * s, 0)
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | o_p.to(tl.int64)
    tl.store(p_out, tl.where(visible, key, key_min), mask=m_p)


def dsa_select(
    cache: torch.Tensor,  # [num_blocks, block_size, 2 Di] key | gate score, new tokens already written
    q: torch.Tensor,  # [T, Hi, Di]
    head_weights: torch.Tensor,  # [T, Hi] float32
    ape: torch.Tensor,  # [kpool, Di]
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, cached + new tokens
    token_seq: torch.Tensor,  # [T] int32, the sequence of each token
    positions: torch.Tensor,  # [T] int32, each token's position in its sequence
    kpool: int,
    topk: int,
    keep_tail: bool,
    cache_scale: torch.Tensor | None = None,  # [num_blocks, block_size, 2] float32 for an e4m3 cache: key | gate
) -> torch.Tensor:  # [T, k * kpool + tail] int32 positions to attend to, -1 = none
    T, Hi, Di = q.shape
    B, W = block_tables.shape
    bs = cache.shape[1]
    fp8 = cache.dtype == torch.float8_e4m3fn
    if cache.shape[2] != 2 * Di or ape.shape != (kpool, Di) or head_weights.shape != (T, Hi):
        raise ValueError(f"dsa_select: cache {tuple(cache.shape)}, ape {tuple(ape.shape)}, weights "
                         f"{tuple(head_weights.shape)} do not fit queries {tuple(q.shape)}")
    if fp8 != (cache_scale is not None) or fp8 and cache_scale.shape != (*cache.shape[:2], 2):
        raise ValueError(f"dsa_select: a {cache.dtype} cache takes scales [blocks, block_size, 2] if and only if it "
                         f"is e4m3, got {None if cache_scale is None else tuple(cache_scale.shape)}")
    if Hi & (Hi - 1) or Di & (Di - 1) or Hi < 16 or Di < 16:
        raise ValueError(f"dsa_select: the Triton path needs power-of-two heads and head dim >= 16, got {Hi}x{Di}")
    P = W * bs // kpool
    dev = q.device
    tail = kpool - 1 if keep_tail and kpool > 1 else 0
    k = min(topk // kpool, P)
    pos = positions.long()
    parts = []
    if k > 0 and T > 0:
        pool_keys = torch.empty(B, P, Di, dtype=q.dtype if fp8 else cache.dtype, device=dev)
        BP = 16  # 16 pools x 128 channels x 8 warps: no register spills (ptxas, sm_90)
        fast(pool_keys_kernel)[(B, triton.cdiv(P, BP))](
            cache, block_tables, seq_lens, ape.contiguous(), pool_keys, W, P, cache.stride(1),
            cache_scale.contiguous() if fp8 else cache, KP=kpool, BS=bs, DI=Di, BP=BP, FP8=fp8, num_warps=8)
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
    if is_deterministic():
        # the tail first: the pools' column count follows the batch's widest block table, and the positions a
        # token attends to must sit in the same columns (thus the same attention blocks) in any batch
        parts.reverse()
    return torch.cat(parts, dim=1).to(torch.int32)

