"""DSA lightning indexer over the paged pool-key cache: scoring, top-k with the tail.

Semantics are ``flashinfra.model.indexer`` (its ``Indexer.select`` is the reference, one sequence at a
time): per complete pool of ``kpool`` cached tokens a compressed key (``kernels.dsa_pool_keys``, cached when the
pool's last token is written); a query scores each pool with ``sum_h w_h relu(q_h . k_pool / sqrt(d))``, keeps
the best ``index_topk / kpool`` pools whose last token it can see (ties to the more recent pool) and always the
incomplete tail pool.

The fast path takes tensors only (no per-sequence Python loop, no host sync), so a decode step can be
captured in a CUDA graph:

1. ``index_score_kernel``: per (block of queries, block of pools) the scores as int32 order-preserving bits
   (``dsa_topk.score_bits``: integer order is float order, a zero of either sign is +0, as the reference's sort sees
   them equal), reading the pool keys ``[num_blocks, block_size // kpool, Di]`` through the block table. Pools the
   query cannot see get the float32 minimum, like the reference; ``P`` is the pool capacity of the (padded) block
   table. The product has the pools as rows and a few queries' heads as columns (``[pools, Di] x [Di, 2 x heads]``:
   each query's weighted sum over its heads stays within a row); a block's queries of one sequence share each key
   tile.
2. ``dsa_topk.select``: per query the ``k`` largest int64 sort keys ``bits << 32 | pool`` in descending
   order (a sort of the row in Triton for short rows, ``torch.topk`` over those keys for long ones: the same
   bits), i.e. the reference's tie rule (ties to the more recent pool). The queries go through steps 1-2 in slices
   of at most ``KEY_BUFFER_BYTES`` of scores (a 1024-token chunk at 1M context would otherwise write 1 GiB); a
   slice's rows are the same bits as in one pass, since each row is its own top-k.
3. ``positions_kernel``: one launch from the top-k keys to the token list ``[T, k * kpool + kpool - 1]``
   (-1 = nothing) that sparse MLA attends to: the selected pools' tokens in the keys' order, then the tail (in
   deterministic mode the tail first, so that each position keeps its column whatever the batch's widest block
   table makes the pools' width).

Cache formats: the pool keys are in the query dtype whatever the entries' format (bf16 or e4m3 + scales), so
scoring, top-k and the tail are one kernel for both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic
from flashinfra.kernels.dsa_topk import select
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait

FMIN = torch.finfo(torch.float32).min
# the most bytes of int32 scores one slice of queries writes before its top-k (1M context: 256 queries a slice)
KEY_BUFFER_BYTES = 256 << 20
# the scoring kernel's tile (notes/dsa_indexer.md has the measurements): pools per program and queries per product
# (fixed, with the warps: a query's bits follow them), queries per program where a sequence has several (prompts),
# the pipeline depth of their loads
SCORE_POOLS, SCORE_COLUMN_QUERIES, SCORE_WARPS = 128, 2, 4
SCORE_QUERIES, SCORE_STAGES = 32, 3
SHARED_KEYS_MIN_QUERIES = 4  # queries per sequence, on average, from which a program scores a block of them


@triton.jit
def _score_bits(b_k, b_q, b_w, pos, o_p, m_p, scale, KP: tl.constexpr, QN: tl.constexpr, HI: tl.constexpr,
                IEEE: tl.constexpr):
    """``[BP, QN]`` order bits of ``QN`` queries (``b_q [QN * HI, DI]``, their heads side by side; ``b_w``, ``pos``
    theirs) against a key tile ``[BP, DI]``: one product with the pools as rows, so each query's weighted sum over
    its heads stays within a row; pools a query cannot see get the float32 minimum's bits. The positive ``scale``
    goes into the head weights (``relu(s * scale) w = relu(s) (scale w)``): one multiply per head, not per pool."""
    if IEEE:
        s = tl.dot(b_k.to(tl.float32), tl.trans(b_q.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(b_k.to(b_q.dtype), tl.trans(b_q))
    s = (b_w * scale)[None, :] * tl.maximum(s, 0.0)
    score = tl.sum(tl.reshape(s, (s.shape[0], QN, HI)), 2)
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where((o_p[:, None] * KP + KP - 1 <= pos[None, :]) & m_p[:, None], bits, -2139095040)


@triton.jit
def _key_tile(pool_keys, block_tables, b, W, o_p, o_d, seen, KP: tl.constexpr, BS: tl.constexpr, DI: tl.constexpr):
    """Sequence ``b``'s pool keys ``o_p`` through its block table, zero where not ``seen``."""
    blk = tl.load(block_tables + b * W + o_p * KP // BS, mask=seen, other=0).to(tl.int64)
    row = blk * (BS // KP) + o_p % (BS // KP)  # the pool's row in the pool-key cache
    return tl.load(pool_keys + row[:, None] * DI + o_d[None, :], mask=seen[:, None], other=0.0)


@triton.jit
def index_score_kernel(q, w, pool_keys, block_tables, token_seq, positions, out, T, W, P, scale, stride_qt, stride_wt,
                       KP: tl.constexpr, BS: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, BT: tl.constexpr,
                       BP: tl.constexpr, QN: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Program (block of ``BT`` queries, block of ``BP`` pools): their score bits, ``QN`` queries per product. Queries
    of one sequence share the key tile, loaded once, while their own loads are pipelined; a block that mixes
    sequences loads each query's tile and puts that query in all ``QN`` columns (the same arithmetic either way)."""
    pdl_wait(PDL)
    i_t, i_p = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    o_d = tl.arange(0, DI)
    o_c = tl.arange(0, QN * HI)  # column c: head c % HI of the block's query c // HI (from the loop's first)
    o_n = tl.arange(0, QN)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    last = tl.max(tl.load(positions + o_t, mask=m_t, other=-1), 0)
    b0 = tl.load(token_seq + i_t * BT)
    mixed = tl.max(tl.where(m_t, tl.load(token_seq + o_t, mask=m_t, other=0) != b0, False), 0)
    if i_p * BP * KP + KP - 1 > last:  # no pool of this block is visible to any query of the block
        tl.store(out + o_t.to(tl.int64)[:, None] * P + o_p[None, :], tl.full([BT, BP], -2139095040, tl.int32),
                 mask=m_t[:, None] & m_p[None, :])
    elif mixed == 0:
        b_k = _key_tile(pool_keys, block_tables, b0.to(tl.int64), W, o_p, o_d, (o_p * KP + KP - 1 <= last) & m_p,
                        KP, BS, DI)
        for i in tl.range(0, BT, QN, num_stages=STAGES):
            # past the block or T: its last query again (the same bits to the same place)
            t_c = tl.minimum(i_t * BT + tl.minimum(i + o_c // HI, BT - 1), T - 1).to(tl.int64)
            t_n = tl.minimum(i_t * BT + tl.minimum(i + o_n, BT - 1), T - 1).to(tl.int64)
            b_q = tl.load(q + t_c[:, None] * stride_qt + (o_c % HI)[:, None] * DI + o_d[None, :])
            b_w = tl.load(w + t_c * stride_wt + o_c % HI)
            bits = _score_bits(b_k, b_q, b_w, tl.load(positions + t_n), o_p, m_p, scale, KP, QN, HI, IEEE)
            tl.store(out + t_n[None, :] * P + o_p[:, None], bits, mask=m_p[:, None])
    else:
        for i in range(0, BT):
            t = tl.minimum(i_t * BT + i, T - 1).to(tl.int64)
            pos = tl.load(positions + t)
            b_k = _key_tile(pool_keys, block_tables, tl.load(token_seq + t).to(tl.int64), W, o_p, o_d,
                            (o_p * KP + KP - 1 <= pos) & m_p, KP, BS, DI)
            b_q = tl.load(q + t * stride_qt + (o_c % HI)[:, None] * DI + o_d[None, :])
            b_w = tl.load(w + t * stride_wt + o_c % HI)
            bits = _score_bits(b_k, b_q, b_w, tl.full([QN], 0, tl.int32) + pos, o_p, m_p, scale, KP, QN, HI, IEEE)
            tl.store(out + t * P + o_p[:, None] + o_n[None, :] * 0, bits, mask=m_p[:, None] & (o_n[None, :] == 0))


@triton.jit(do_not_specialize=["k", "S"])  # sizes that vary with the context: one compilation for all
def positions_kernel(top, positions, out, k, S, KP: tl.constexpr, BK: tl.constexpr, TAIL: tl.constexpr,
                     BT: tl.constexpr, TAIL_FIRST: tl.constexpr, PDL: tl.constexpr = False):
    """Per query its row of positions: the ``k`` chosen pools' tokens (-1 for a pool it cannot see) and the tail's
    (-1 past the query), the tail last, or first under ``TAIL_FIRST``."""
    pdl_wait(PDL)
    i_t = tl.program_id(0)
    pos = tl.load(positions + i_t).to(tl.int64)
    p_out = out + i_t.to(tl.int64) * S
    if TAIL_FIRST:
        pools_at = TAIL
        tail_at = 0
    else:
        pools_at = 0
        tail_at = k * KP
    if BK > 0:
        o_k = tl.arange(0, BK)
        m_k = o_k < k
        pool = tl.load(top + i_t.to(tl.int64) * k + o_k, mask=m_k, other=0) & 0xFFFFFFFF  # the sort key's low word
        seen = pool * KP + KP - 1 <= pos
        for j in tl.static_range(KP):
            tl.store(p_out + pools_at + o_k * KP + j, tl.where(seen, pool * KP + j, -1).to(tl.int32), mask=m_k)
    if TAIL > 0:
        o_j = tl.arange(0, BT)
        tok = pos + 1 - (pos + 1) % KP + o_j
        tl.store(p_out + tail_at + o_j, tl.where(tok <= pos, tok, -1).to(tl.int32), mask=o_j < TAIL)


def scores_launch(pool_keys, q, w, block_tables, token_seq, positions, kpool: int, out) -> torch.Tensor:
    """out [T, P] int32 (P the block table's pool capacity): every query's score bits for every pool."""
    T, Hi, Di = q.shape
    B, W = block_tables.shape
    bs = pool_keys.shape[1] * kpool
    P = out.shape[1]
    # a block of queries per program where the batch has several per sequence (prompts), else one (decode rows): a
    # query's bits do not depend on it (the same product per query), only how often the key tiles are read
    BT = SCORE_QUERIES if T >= SHARED_KEYS_MIN_QUERIES * B else 1
    fast(index_score_kernel)[(cdiv(T, BT), cdiv(P, SCORE_POOLS))](
        q, w, pool_keys, block_tables, token_seq, positions, out, T, W, P, Di**-0.5, q.stride(0), w.stride(0),
        KP=kpool, BS=bs, HI=Hi, DI=Di, BT=BT, BP=SCORE_POOLS, QN=SCORE_COLUMN_QUERIES, STAGES=SCORE_STAGES,
        IEEE=q.dtype == torch.float32, num_warps=SCORE_WARPS)
    return out


def slice_rows(T: int, P: int) -> int:
    """Queries per slice of the selection: as many as ``KEY_BUFFER_BYTES`` of scores hold, in whole multiples of 16
    where there are that many, so that each slice's tensors start as aligned as the whole batch's: Triton specialises
    pointers on that, and a long prompt then runs the kernel variants its warm-up compiled."""
    rows = min(T, KEY_BUFFER_BYTES // (4 * P))
    return max(1, rows if rows == T or rows < 16 else rows // 16 * 16)


def select_pools(pool_keys, q, w, block_tables, token_seq, positions, kpool: int, k: int) -> torch.Tensor:
    """[T, k] int64: each query's ``k`` best sort keys, best first (the pool in the low word; pools the query cannot
    see come last), the queries in slices of at most ``KEY_BUFFER_BYTES`` of scores."""
    T = q.shape[0]
    P = block_tables.shape[1] * pool_keys.shape[1]
    rows = slice_rows(T, P)
    scores = torch.empty(rows, P, dtype=torch.int32, device=q.device)
    top = torch.empty(T, k, dtype=torch.int64, device=q.device)
    for t0 in range(0, T, rows):
        n = min(rows, T - t0)
        s = slice(t0, t0 + n)
        scores_launch(pool_keys, q[s], w[s], block_tables, token_seq[s], positions[s], kpool, scores[:n])
        select(scores[:n], k, top[s], positions[s], kpool)
    return top


def select_bytes(T: int, P: int, k: int) -> int:
    """Bytes of the selection beyond the pool keys: the scores written, then read once by the top-k, which writes
    the keys (the sort's traffic)."""
    return 4 * T * P + 4 * T * P + 8 * T * k


def dsa_select(
    pool_keys: torch.Tensor,  # [num_blocks, block_size // kpool, Di] every complete pool's key, new ones included
    q: torch.Tensor,  # [T, Hi, Di]
    head_weights: torch.Tensor,  # [T, Hi] float32
    block_tables: torch.Tensor,  # [B, W] int32
    token_seq: torch.Tensor,  # [T] int32, the sequence of each token
    positions: torch.Tensor,  # [T] int32, each token's position in its sequence
    kpool: int,
    topk: int,
    keep_tail: bool,
) -> torch.Tensor:  # [T, k * kpool + tail] int32 positions to attend to, -1 = none
    T, Hi, Di = q.shape
    B, W = block_tables.shape
    if pool_keys.shape[2] != Di or head_weights.shape != (T, Hi):
        raise ValueError(f"dsa_select: pool keys {tuple(pool_keys.shape)}, weights {tuple(head_weights.shape)} do "
                         f"not fit queries {tuple(q.shape)}")
    if Hi & (Hi - 1) or Di & (Di - 1) or Hi < 16 or Di < 16:
        raise ValueError(f"dsa_select: the Triton path needs power-of-two heads and head dim >= 16, got {Hi}x{Di}")
    P = W * pool_keys.shape[1]
    dev = q.device
    tail = kpool - 1 if keep_tail and kpool > 1 else 0
    k = min(topk // kpool, P) if T else 0
    S = k * kpool + tail
    if T == 0 or S == 0:
        return torch.full((T, S or 1), -1, dtype=torch.int32, device=dev)
    top = positions  # not read when no pool is chosen
    if k:
        q = q if q.stride(-1) == 1 and q.stride(-2) == Di else q.contiguous()
        w = head_weights.float().contiguous()
        top = select_pools(pool_keys, q, w, block_tables, token_seq, positions, kpool, k)  # [T, k]
    # deterministic mode puts the tail first: the pools' column count follows the batch's widest block table, and
    # the positions a token attends to must sit in the same columns (thus the same attention blocks) in any batch
    return positions_launch(top, positions, kpool, k, tail, is_deterministic())


def positions_launch(top, positions, kpool: int, k: int, tail: int, tail_first: bool, out=None) -> torch.Tensor:
    """top [T, k] int64 sort keys (unread when ``k`` is 0), positions [T] -> [T, k * kpool + tail] int32."""
    T = positions.shape[0]
    out = torch.empty(T, k * kpool + tail, dtype=torch.int32, device=positions.device) if out is None else out
    if T:
        fast(positions_kernel)[(T,)](top, positions, out, k, out.shape[1], KP=kpool,
                                     BK=next_power_of_2(k) if k else 0, TAIL=tail,
                                     BT=next_power_of_2(tail) if tail else 0, TAIL_FIRST=tail_first,
                                     num_warps=4)
    return out


def positions_ref(top, positions, kpool: int, k: int, tail: int, tail_first: bool) -> torch.Tensor:
    pos = positions.long()
    parts = []
    if k:
        pools = top[:, :k] & 0xFFFFFFFF
        toks = pools[:, :, None] * kpool + torch.arange(kpool, device=pos.device)
        seen = (pools * kpool + kpool - 1 <= pos[:, None])[:, :, None]
        parts.append(torch.where(seen, toks, -1).flatten(1))
    if tail:
        toks = (pos + 1 - (pos + 1) % kpool)[:, None] + torch.arange(tail, device=pos.device)
        parts.append(torch.where(toks <= pos[:, None], toks, -1))
    return torch.cat(parts[::-1] if tail_first else parts, dim=1).to(torch.int32)
