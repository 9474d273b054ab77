"""Sparse MLA attention on the paged latent cache over the DSA selection (absorbed form).

With ``kv_b`` split into ``w_uk`` [H, Dq, R] and ``w_uv`` [H, Dv, R], attention of query head ``h`` over
latents ``c`` is ``softmax(scale * (q_h w_uk_h) . c) c`` followed by ``w_uv_h``: all heads of a token
share the same latent rows, so one program scores ``BH`` heads against ``BN`` gathered latent rows with
one matrix product (``[BH, R] x [R, BN]``), and accumulates ``[BH, R]`` with another. The same kernel
serves prefill and decode: a token attends to its own list of positions (``dsa_select``'s output), read
through its sequence's block table. This is the form DeepSeek's sparse FlashMLA uses for both phases;
expanding the latent per head instead would make every head's keys different and leave matrix units
with one query row per head.

Splits (flash-decoding): when there are too few (token, head block) programs to fill the chip (decode at
small batch), each token's list is cut into ``SPLIT`` chunks whose partial (max, sum, acc) are merged
by ``sparse_mla_combine_kernel``.

Cache formats (``CACHE``, a constexpr read from the latent's dtype): a float latent (bf16, or float32 in tests),
or 8-bit rows (``int8`` or e4m3 ``fp8``) with one float32 scale per token, dequantized on load
(``c = q_c * s``, rounded to the query dtype), so a step reads about half the latent bytes of a bf16 cache.
Everything after the load (scores, online softmax, splits and their merge) is the same for every format. The
scale pointer comes after the float kernel's arguments, so that the float specialisation keeps its parameter
layout (and its machine code).

``sparse_mla_ref`` is the reference: one token at a time, as the model's ``_decode``, in float32 or in the
query's dtype where that is wider (float64 for the checks), on the dequantized latent rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import is_deterministic, use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait

# the most splits of all programs' lists together (flash-decoding): the merge reads splits x H x R float32 partials
# per token, so a batch of several programs splits each less
MAX_SPLIT = 64

# the latent's element type -> the kernel's cache format; 8-bit formats carry a float32 scale per token
CACHE_FORMATS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def cache_format(latent: torch.Tensor, latent_scale: torch.Tensor | None) -> str:
    """``"float"``, ``"int8"`` or ``"fp8"`` from the latent's dtype; an 8-bit latent needs its scales."""
    fmt = CACHE_FORMATS.get(latent.dtype, "float")
    if (fmt == "float") != (latent_scale is None):
        raise ValueError(f"sparse_mla: a {latent.dtype} latent {'needs' if fmt != 'float' else 'takes no'} "
                         "per-token scales")
    if fmt != "float" and (latent_scale.shape != latent.shape[:2] or latent_scale.dtype != torch.float32):
        raise ValueError(f"sparse_mla: latent scale {tuple(latent_scale.shape)} {latent_scale.dtype} does not fit "
                         f"latent {tuple(latent.shape)} (float32 [blocks, block_size])")
    return fmt


def sparse_mla_ref(q_lat, latent, sel, token_seq, block_tables, scale, latent_scale=None):
    """q_lat [T, H, R], latent [blocks, bs, R] (float, or int8 / e4m3 with latent_scale float32 [blocks, bs]),
    sel [T, S] positions (-1 none) -> o_lat [T, H, R] in q's dtype."""
    T, H, R = q_lat.shape
    bs = latent.shape[1]
    out = torch.empty_like(q_lat)
    ct = torch.promote_types(q_lat.dtype, torch.float32)
    flat = latent.reshape(-1, R)
    for t in range(T):
        idx = sel[t][sel[t] >= 0].long()
        rows = block_tables[int(token_seq[t])].long()[idx // bs] * bs + idx % bs
        c = flat[rows].to(ct)  # [n, R]
        if latent_scale is not None:
            c = c * latent_scale.reshape(-1)[rows].to(ct)[:, None]
        p = torch.softmax(q_lat[t].to(ct) @ c.t() * scale, dim=-1)
        out[t] = (p @ c).to(q_lat.dtype)
    return out


@triton.jit
def sparse_mla_kernel(q, latent, sel, token_seq, block_tables, o, part_acc, part_ml, stride_qt, stride_qh, S, W, H,
                      CH, scale, latent_scale, R: tl.constexpr, BR: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr,
                      BN: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, CACHE: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t, i_h, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i_t.to(tl.int64)
    b = tl.load(token_seq + i_t).to(tl.int64)
    o_h = i_h * BH + tl.arange(0, BH)
    o_r = tl.arange(0, BR)
    m_h, m_r = o_h < H, o_r < R
    b_q = tl.load(q + t * stride_qt + o_h[:, None] * stride_qh + o_r[None, :], mask=m_h[:, None] & m_r[None, :],
                  other=0.0)
    m_i = tl.full([BH], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BR], dtype=tl.float32)
    end = tl.minimum(i_s * CH + CH, S)
    for n0 in range(i_s * CH, end, BN):
        o_n = n0 + tl.arange(0, BN)
        idx = tl.load(sel + t * S + o_n, mask=o_n < end, other=-1)
        valid = idx >= 0
        blk = tl.load(block_tables + b * W + idx // BS, mask=valid, other=0).to(tl.int64)
        row = blk * BS + idx % BS
        c = tl.load(latent + row[:, None] * R + o_r[None, :], mask=valid[:, None] & m_r[None, :], other=0.0)
        if CACHE != "float":  # 8-bit rows: dequantized with their token's scale, in the query dtype
            c_s = tl.load(latent_scale + row, mask=valid, other=0.0)
            c = (c.to(tl.float32) * c_s[:, None]).to(b_q.dtype)
        if IEEE:
            s = tl.dot(b_q.to(tl.float32), tl.trans(c.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(b_q, tl.trans(c))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new
    m_out = m_h[:, None] & m_r[None, :]
    if SPLIT == 1:
        tl.store(o + (t * H + o_h[:, None]) * R + o_r[None, :], (acc / l_i[:, None]).to(o.dtype.element_ty),
                 mask=m_out)
    else:
        base = (t * SPLIT + i_s) * H + o_h
        tl.store(part_acc + base[:, None] * BR + o_r[None, :], acc, mask=m_out)
        tl.store(part_ml + base * 2, m_i, mask=m_h)
        tl.store(part_ml + base * 2 + 1, l_i, mask=m_h)


@triton.jit
def sparse_mla_combine_kernel(part_acc, part_ml, o, H, R: tl.constexpr, BR: tl.constexpr, SPLIT: tl.constexpr,
                              PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t = i_t.to(tl.int64)
    o_s = tl.arange(0, SPLIT)
    o_r = tl.arange(0, BR)
    base = (t * SPLIT + o_s) * H + i_h
    m = tl.load(part_ml + base * 2)
    l = tl.load(part_ml + base * 2 + 1)
    scale = tl.exp(m - tl.max(m, 0))
    acc = tl.load(part_acc + base[:, None] * BR + o_r[None, :])
    out = tl.sum(acc * scale[:, None], 0) / tl.sum(l * scale, 0)
    tl.store(o + (t * H + i_h) * R + o_r, out.to(o.dtype.element_ty), mask=o_r < R)


def _config(T: int, H: int, BR: int, elem_bytes: int = 2) -> dict:
    """Block shapes: ``BH`` heads of a token share each gathered block of ``BN`` latent rows. All 64 heads
    in one program with 64-row blocks: each gathered row is read once per token, and the products are
    64 x 64 tiles."""
    if elem_bytes > 2:  # float32 tiles of that shape exceed shared memory
        return dict(BH=max(16, min(32, next_power_of_2(H))), BN=32, num_warps=8 if BR >= 256 else 4,
                    num_stages=2)
    return dict(BH=max(16, min(64, next_power_of_2(H))), BN=64, num_warps=8 if BR >= 256 else 4,
                num_stages=2)


def sparse_mla_launch(q_lat, latent, sel, token_seq, block_tables, scale: float, latent_scale=None,
                      split: int | None = None):
    T, H, R = q_lat.shape
    if latent.dim() != 3 or latent.shape[2] != R or not latent.is_contiguous():
        raise ValueError(f"sparse_mla: latent must be contiguous [blocks, block_size, {R}], got {tuple(latent.shape)}")
    fmt = cache_format(latent, latent_scale)
    if sel.dim() != 2 or sel.shape[0] != T or token_seq.shape != (T,) or block_tables.dim() != 2:
        raise ValueError(f"sparse_mla: sel {tuple(sel.shape)}, token_seq {tuple(token_seq.shape)}, block tables "
                         f"{tuple(block_tables.shape)} do not fit {T} tokens")
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    sel, block_tables = sel.contiguous(), block_tables.contiguous()
    o = torch.empty(T, H, R, dtype=q_lat.dtype, device=q_lat.device)
    if T == 0:
        return o
    S, BR = sel.shape[1], next_power_of_2(R)
    cfg = _config(T, H, BR, q_lat.element_size())
    BH, BN = cfg["BH"], cfg["BN"]
    programs = T * cdiv(H, BH)
    if split is None and is_deterministic():  # one program per token's whole list: a fixed order
        split = 1
    if split is None:
        split = 1 if programs >= 132 else min(max(1, MAX_SPLIT // programs),
                                              next_power_of_2(cdiv(264, programs)),
                                              next_power_of_2(cdiv(S, BN)))
    CH = cdiv(cdiv(S, split), BN) * BN
    dev = q_lat.device
    part_acc = torch.empty(T * split * H, BR, dtype=torch.float32, device=dev) if split > 1 else o
    part_ml = torch.empty(T * split * H, 2, dtype=torch.float32, device=dev) if split > 1 else o
    fast(sparse_mla_kernel)[(T, cdiv(H, BH), split)](
        q_lat, latent, sel, token_seq, block_tables, o, part_acc, part_ml, q_lat.stride(0), q_lat.stride(1), S,
        block_tables.shape[1], H, CH, scale, latent if latent_scale is None else latent_scale.contiguous(), R=R, BR=BR,
        BS=latent.shape[1], BH=BH, BN=BN, SPLIT=split, IEEE=q_lat.dtype == torch.float32, CACHE=fmt,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:
        fast(sparse_mla_combine_kernel)[(T, H)](part_acc, part_ml, o, H, R=R, BR=BR, SPLIT=split, num_warps=4)
    return o


def sparse_mla(q_lat, latent, sel, token_seq, block_tables, scale: float, latent_scale=None):
    if use_triton(q_lat, latent, sel):
        return sparse_mla_launch(q_lat, latent, sel, token_seq, block_tables, scale, latent_scale)
    return sparse_mla_ref(q_lat, latent, sel, token_seq, block_tables, scale, latent_scale)
