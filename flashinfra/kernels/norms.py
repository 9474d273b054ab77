"""RMSNorm flavours of GLM-5.3-Flash: references and fused Triton kernels.

- ``rms_norm``: normalise in float32, cast back, then scale by the weight (in the input dtype).
- ``add_rms_norm``: the residual add ``x + r`` (in the input dtype) and ``rms_norm`` of the sum, both returned,
  in one pass (the sum is written where the norm reads it).
- ``gated_rms_norm``: the KDA output norm, entirely in float32, times ``sigmoid(gate)``, cast back.
- ``unweighted_rms_norm``: the mHC input norm (no weight); its fused form lives in ``mhc.py``.

Triton path: one program per block of ``BT`` rows, each row read once and written once (the rows of a
norm are at most a few thousand wide, so a whole row sits in registers). ``rms_norm`` rounds exactly where
the reference rounds (the normalised row to the input dtype, then the product with the weight).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def unweighted_rms_norm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + r
    return s, rms_norm_ref(s, weight, eps)


@triton.jit
def rms_norm_rows(b_x, b_w, D, eps, dtype: tl.constexpr):
    """RMSNorm of rows in registers (float32 of rows in ``dtype``; masked columns zero) times the weight ``b_w`` (the
    row's columns, loaded by the caller: as early as its kernel allows), with the reference's roundings to ``dtype``
    (the normed rows, then the product): the one arithmetic of every kernel that norms whole rows (this module's,
    ``quant.norm_act``'s, mHC's collapse)."""
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_n = (b_x * b_r[:, None]).to(dtype)
    return (b_w[None, :].to(tl.float32) * b_n.to(tl.float32)).to(dtype)


@triton.jit
def rms_norm_kernel(x, w, y, stride_x, stride_y, N, D, eps, r, s, cache, slots, BT: tl.constexpr, BD: tl.constexpr,
                    HAS_RES: tl.constexpr, TO_SLOTS: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t < N)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + o_t[:, None].to(tl.int64) * stride_x + o_d[None, :], mask=m, other=0.0)
    if HAS_RES:  # r and s are contiguous [N, D]; the sum rounds to the input dtype as the reference's add does
        p_rs = o_t[:, None].to(tl.int64) * D + o_d[None, :]
        b_x = (b_x.to(tl.float32) + tl.load(r + p_rs, mask=m, other=0.0).to(tl.float32)).to(s.dtype.element_ty)
        tl.store(s + p_rs, b_x, mask=m)
    b_y = rms_norm_rows(b_x.to(tl.float32), tl.load(w + o_d, mask=o_d < D, other=0.0), D, eps, y.dtype.element_ty)
    tl.store(y + o_t[:, None].to(tl.int64) * stride_y + o_d[None, :], b_y, mask=m)
    if TO_SLOTS:  # the rows also into a cache's rows [S, D] at their slots (negative: none)
        slot = tl.load(slots + o_t, mask=o_t < N, other=-1).to(tl.int64)
        tl.store(cache + slot[:, None] * D + o_d[None, :], b_y, mask=m & (slot >= 0)[:, None])


@triton.jit
def gated_rms_norm_kernel(x, g, w, y, stride_x, stride_g, N, D, eps, BT: tl.constexpr, BD: tl.constexpr):
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m = (o_t < N)[:, None] & (o_d < D)[None, :]
    rows = o_t[:, None].to(tl.int64)
    b_x = tl.load(x + rows * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(g + rows * stride_g + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_y = b_w[None, :] * (b_x * b_r[:, None]) * tl.sigmoid(b_g)
    tl.store(y + rows * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor, D: int, name: str) -> torch.Tensor:
    if x.shape[-1] != D:
        raise ValueError(f"{name}: last dim {x.shape[-1]} != weight size {D}")
    x2 = x.reshape(-1, D)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _output(x: torch.Tensor, out: torch.Tensor | None, name: str) -> torch.Tensor:
    """``out``, checked to take the op's result in place (x's shape and dtype, contiguous), or a fresh one."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous {tuple(x.shape)} {x.dtype}")
    return y


def _block_rows(D: int) -> tuple[int, int]:
    BD = next_power_of_2(D)
    return BD, max(1, min(16, 4096 // BD))


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None):
    D = weight.shape[0]
    x2 = _rows(x, D, "rms_norm")
    y = _output(x, out, "rms_norm")
    N = x2.shape[0]
    if N:
        BD, BT = _block_rows(D)
        fast(rms_norm_kernel)[(cdiv(N, BT),)](x2, weight, y, x2.stride(0), D, N, D, eps, x2, y, y, y, BT=BT, BD=BD,
                                              HAS_RES=False, num_warps=4 if BD <= 2048 else 8)
    return y


def rms_norm_to_slots_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, cache_rows: torch.Tensor,
                             slots: torch.Tensor) -> torch.Tensor:
    """``rms_norm`` of ``x`` [T, D], its rows also stored at ``slots`` [T] (negative: none) of ``cache_rows`` [S, D]
    (contiguous, x's dtype), in one launch -> the normed rows."""
    D = weight.shape[0]
    x2 = _rows(x, D, "rms_norm_to_slots")
    N = x2.shape[0]
    if (cache_rows.dim() != 2 or cache_rows.shape[1] != D or cache_rows.dtype != x.dtype
            or not cache_rows.is_contiguous() or slots.shape != (N,)):
        raise ValueError(f"rms_norm_to_slots: cache rows {tuple(cache_rows.shape)} {cache_rows.dtype} and slots "
                         f"{tuple(slots.shape)} do not fit {N} rows of {D} {x.dtype}")
    y = torch.empty(N, D, dtype=x.dtype, device=x.device)
    if N:
        BD, BT = _block_rows(D)
        fast(rms_norm_kernel)[(cdiv(N, BT),)](x2, weight, y, x2.stride(0), D, N, D, eps, x2, y, cache_rows,
                                              slots.contiguous(), BT=BT, BD=BD, HAS_RES=False, TO_SLOTS=True,
                                              num_warps=4 if BD <= 2048 else 8)
    return y


def add_rms_norm_launch(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float, out=None):
    """-> (x + r, rms_norm(x + r)), both contiguous like ``x`` (``out``: the two tensors to write into)."""
    D = weight.shape[0]
    if r.shape != x.shape or r.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: r {tuple(r.shape)} {r.dtype} != x {tuple(x.shape)} {x.dtype}")
    x2, r2 = _rows(x, D, "add_rms_norm"), r.reshape(-1, D).contiguous()
    s, y = (_output(x, o, "add_rms_norm") for o in (out or (None, None)))
    N = x2.shape[0]
    if N:
        BD, BT = _block_rows(D)
        fast(rms_norm_kernel)[(cdiv(N, BT),)](x2, weight, y, x2.stride(0), D, N, D, eps, r2, s, y, y, BT=BT, BD=BD,
                                              HAS_RES=True, num_warps=4 if BD <= 2048 else 8)
    return s, y


def gated_rms_norm_launch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          out: torch.Tensor | None = None):
    D = weight.shape[0]
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} != x {tuple(x.shape)}")
    x2, g2 = _rows(x, D, "gated_rms_norm"), _rows(gate, D, "gated_rms_norm")
    y = _output(x, out, "gated_rms_norm")
    N = x2.shape[0]
    if N:
        BD, BT = _block_rows(D)
        fast(gated_rms_norm_kernel)[(cdiv(N, BT),)](
            x2, g2, weight, y, x2.stride(0), g2.stride(0), N, D, eps, BT=BT, BD=BD, num_warps=4)
    return y


def rms_norm(x, weight, eps):
    if use_triton(x, weight):
        return rms_norm_launch(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def gated_rms_norm(x, gate, weight, eps):
    if use_triton(x, gate, weight):
        return gated_rms_norm_launch(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)
