"""The DSA indexer's pool-key cache: one compressed key per complete pool of ``kpool`` cached tokens, written once,
when the pool's last token is written, and read by the scoring kernel (``kernels.dsa_indexer``) through the block
table instead of being recomputed from the entries on every step.

Layout: ``pool_keys [num_blocks, block_size // kpool, Di]`` in the query (model) dtype beside the entries
``[num_blocks, block_size, 2 Di]`` (key | gate score). ``block_size % kpool == 0``, so a pool never straddles two
blocks and the pool of the token at flat slot ``s`` is flat pool row ``s // kpool``; a token completes its pool
exactly when ``(s + 1) % kpool == 0`` (slot and position agree modulo ``kpool``). Writing by slot needs neither
the block table nor the positions, and a pool key travels with its block (prefix-cache hits, disaggregated
transfers, Layer Split broadcasts).

Invariant: a pool's key is valid once its last token's entry has been written after the others' (the engine
writes a sequence's entries in position order, so a rewrite after rejected drafts or a preemption recomputes
it); the scoring kernel reads only pools whose last token is at or before the query's position.

Values: per channel a softmax over the pool's tokens of gate score + position bias weights their keys, rounded
where the reference rounds (``compress_pools``, which ``model.indexer.Indexer.select`` calls): the probabilities
and each product in the model dtype, the sum in float32. Fp8 entries (one float32 scale per token and half) are
dequantized and rounded to the model dtype first, as ``quant.cache.read_index_entries`` does
(``dequant_entries``). The kernel and the reference write the same rows; only the kernel's exp may differ by a
rounding from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, pdl_wait


@triton.jit
def _entry(cache, scale, row, m, o_d, stride_cb, half: tl.constexpr, dt: tl.constexpr, DI: tl.constexpr,
           FP8: tl.constexpr):
    """[BP, DI] float32: half ``half`` (0 key, 1 gate score) of the entries at ``row``, fp8 dequantized and rounded
    to ``dt`` as the reference reads them."""
    v = tl.load(cache + row[:, None] * stride_cb + half * DI + o_d[None, :], mask=m[:, None], other=0.0)
    v = v.to(tl.float32)
    if FP8:
        v = (v * tl.load(scale + row * 2 + half, mask=m, other=0.0)[:, None]).to(dt).to(tl.float32)
    return v


@triton.jit
def pool_keys_write_kernel(cache, scale, ape, slot_mapping, pool_keys, T, stride_cb, KP: tl.constexpr,
                           DI: tl.constexpr, BP: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t = tl.program_id(0)
    o_t = i_t * BP + tl.arange(0, BP)
    o_d = tl.arange(0, DI)
    s = tl.load(slot_mapping + o_t, mask=o_t < T, other=-1).to(tl.int64)
    m = (s >= 0) & ((s + 1) % KP == 0)  # the tokens that complete a pool
    row0 = tl.where(m, s - (KP - 1), 0)
    dt = pool_keys.dtype.element_ty
    mx = tl.full([BP, DI], float("-inf"), dtype=tl.float32)
    for j in tl.static_range(KP):
        g = _entry(cache, scale, row0 + j, m, o_d, stride_cb, 1, dt, DI, FP8)
        mx = tl.maximum(mx, g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :])
    den = tl.zeros([BP, DI], dtype=tl.float32)
    for j in tl.static_range(KP):
        g = _entry(cache, scale, row0 + j, m, o_d, stride_cb, 1, dt, DI, FP8)
        den += tl.exp(g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :] - mx)
    acc = tl.zeros([BP, DI], dtype=tl.float32)
    for j in tl.static_range(KP):
        g = _entry(cache, scale, row0 + j, m, o_d, stride_cb, 1, dt, DI, FP8)
        k = _entry(cache, scale, row0 + j, m, o_d, stride_cb, 0, dt, DI, FP8)
        prob = (tl.exp(g + tl.load(ape + j * DI + o_d).to(tl.float32)[None, :] - mx) / den).to(dt).to(tl.float32)
        acc += (prob * k).to(dt).to(tl.float32)  # the reference multiplies in the model dtype, sums in float32
    tl.store(pool_keys + (s // KP)[:, None] * DI + o_d[None, :], acc.to(dt), mask=m[:, None])


def _check(cache, scale, ape, pool_keys):
    kp, Di = ape.shape
    fp8 = cache.dtype == torch.float8_e4m3fn
    if (cache.shape[2] != 2 * Di or pool_keys.shape != (cache.shape[0], cache.shape[1] // kp, Di)
            or cache.shape[1] % kp):
        raise ValueError(f"pool keys {tuple(pool_keys.shape)} do not fit entries {tuple(cache.shape)} with "
                         f"kpool {kp} (the block size must be a multiple of kpool)")
    if fp8 != (scale is not None) or not fp8 and cache.dtype != pool_keys.dtype:
        raise ValueError(f"pool keys: {cache.dtype} entries (scales {scale is not None}) into {pool_keys.dtype} "
                         f"keys: e4m3 entries take scales, others are in the keys' dtype")


def write_pool_keys_launch(cache, scale, ape, slot_mapping, pool_keys) -> None:
    _check(cache, scale, ape, pool_keys)
    T = slot_mapping.shape[0]
    if T == 0:
        return
    kp, Di = ape.shape
    fp8 = scale is not None
    BP = 16  # 16 pools x 128 channels x 8 warps: no register spills (ptxas, sm_90)
    fast(pool_keys_write_kernel)[(cdiv(T, BP),)](
        cache, scale.contiguous() if fp8 else cache, ape.contiguous(), slot_mapping.contiguous(), pool_keys, T,
        cache.stride(1), KP=kp, DI=Di, BP=BP, FP8=fp8, num_warps=8)


def dequant_entries(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Indexer entries [n, 2 Di] in ``dtype``: e4m3 codes times their scale per half ([n, 2]) in float32, else a
    cast."""
    if scale is None:
        return rows.to(dtype)
    n = rows.shape[0]
    ct = torch.promote_types(dtype, torch.float32)
    return (rows.to(ct).view(n, 2, rows.shape[-1] // 2) * scale.to(ct)[:, :, None]).view(rows.shape).to(dtype)


def compress_pools(entries: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pools' entries [P, kpool, 2 Di] -> their keys [P, Di] in the entries' dtype (the model's definition)."""
    keys, gates = entries.split(entries.shape[-1] // 2, dim=-1)
    probs = torch.softmax(gates.float() + ape.float()[None], dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def write_pool_keys_ref(cache, scale, ape, slot_mapping, pool_keys) -> None:
    _check(cache, scale, ape, pool_keys)
    kp, Di = ape.shape
    s = slot_mapping.long()
    s = s[(s >= 0) & ((s + 1) % kp == 0)]
    rows = (s[:, None] - (kp - 1) + torch.arange(kp, device=s.device)).flatten()
    flat_scale = None if scale is None else scale.view(-1, 2)[rows]
    entries = dequant_entries(cache.view(-1, 2 * Di)[rows], flat_scale, pool_keys.dtype)
    pool_keys.view(-1, Di)[s // kp] = compress_pools(entries.view(-1, kp, 2 * Di), ape)


def write_pool_keys(
    cache: torch.Tensor,  # [num_blocks, block_size, 2 Di] key | gate score, the new tokens already written
    scale: torch.Tensor | None,  # [num_blocks, block_size, 2] float32 for an e4m3 cache: key | gate
    ape: torch.Tensor,  # [kpool, Di] the pool's position bias
    slot_mapping: torch.Tensor,  # [T] the new tokens' flat slots (negative: none)
    pool_keys: torch.Tensor,  # [num_blocks, block_size // kpool, Di] written where a new token completes a pool
) -> None:
    if use_triton(cache, pool_keys):
        write_pool_keys_launch(cache, scale, ape, slot_mapping, pool_keys)
    else:
        write_pool_keys_ref(cache, scale, ape, slot_mapping, pool_keys)
