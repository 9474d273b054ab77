"""RMSNorm fused with the per-token int8 quantization of its output (W8A8): one kernel where ``norms.rms_norm`` then
``act.quant_int8_per_token`` were two.

``rms_norm_int8(x, weight, eps, keep_normed)``: ``x`` [..., D] -> ``(y, q, s)`` with ``y = rms_norm(x)`` in x's
dtype (None unless ``keep_normed``: only where a consumer other than an int8 projection reads it, the router or
the indexer), ``q`` int8 [T, D] and ``s`` float32 [T] the int8 codes and scales of ``y`` exactly as
``quant_int8_per_token(y)`` forms them. The arithmetic is the two ops' own in their order (``y`` rounded to x's
dtype, then the scale from its amax), so the fused op's results are those of the pair, bit for bit, on the
CPU; compiled for a GPU, each kernel sums a row's squares in its own register layout's order, so a norm may differ
in its last float32 bit there (and, rarely, a code at a rounding tie).

Why in the norm's epilogue and not in the GEMM's prologue: the norm already holds each whole row in registers
(a row of the model width sits in one program), so the row's amax costs nothing there, while a GEMM program sees
``BK`` columns of ``BM`` rows at a time and would read its bf16 rows twice (amax, then quantize) for every one of
its ``N / BN`` column tiles. The counts (bench/notes/quant.md): per projection of ``T`` rows of width ``D``, the
pair moves ``2TD`` (norm write) + ``4TD`` (quant reads, two passes) + ``TD + 4T`` (codes) bytes in two launches;
the fused kernel ``TD + 4T`` (+ ``2TD`` where ``y`` is kept) in one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait
from flashinfra.kernels.norms import rms_norm_ref, rms_norm_rows
from flashinfra.kernels.quant.act import int8_rows, quant_int8_per_token_ref


def rms_norm_int8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, keep_normed: bool):
    y = rms_norm_ref(x, weight, eps)
    q, s = quant_int8_per_token_ref(y.reshape(-1, y.shape[-1]))
    return (y if keep_normed else None), q, s


@triton.jit
def rms_norm_int8_kernel(x, w, y, q, s, stride_x, N, D, eps, BT: tl.constexpr, BD: tl.constexpr,
                         STORE_Y: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t = o_t < N
    m = m_t[:, None] & (o_d < D)[None, :]
    rows = o_t[:, None].to(tl.int64)
    b_x = tl.load(x + rows * stride_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = rms_norm_rows(b_x, tl.load(w + o_d, mask=o_d < D, other=0.0), D, eps, x.dtype.element_ty)
    if STORE_Y:
        tl.store(y + rows * D + o_d[None, :], b_y, mask=m)
    codes, scale = int8_rows(b_y.to(tl.float32))  # quant_int8_per_token of the rounded rows
    tl.store(q + rows * D + o_d[None, :], codes, mask=m)
    tl.store(s + o_t, scale, mask=m_t)


def _outputs(x: torch.Tensor, N: int, D: int, keep_normed: bool, out):
    """The (y, q, s) buffers: fresh, or ``out``'s (the checks poison them first) after their shapes are checked."""
    if out is None:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if keep_normed else None
        return y, torch.empty(N, D, dtype=torch.int8, device=x.device), torch.empty(N, dtype=torch.float32,
                                                                                 device=x.device)
    y, q, s = out
    ok = (q.shape == (N, D) and q.dtype == torch.int8 and s.shape == (N,) and s.dtype == torch.float32
          and (y is None) != keep_normed and (y is None or (y.shape == x.shape and y.dtype == x.dtype)))
    if not ok or not all(t.is_contiguous() for t in out if t is not None):
        raise ValueError(f"rms_norm_int8: out must be contiguous (y {tuple(x.shape)} {x.dtype} where kept, "
                         f"q [{N}, {D}] int8, s [{N}] float32)")
    return y, q, s


def rms_norm_int8_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, keep_normed: bool, out=None):
    D = weight.shape[0]
    if x.shape[-1] != D:
        raise ValueError(f"rms_norm_int8: last dim {x.shape[-1]} != weight size {D}")
    x2 = x.reshape(-1, D)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    N = x2.shape[0]
    y, q, s = _outputs(x, N, D, keep_normed, out)
    if N:
        BD = next_power_of_2(D)
        BT = max(1, min(16, 4096 // BD))  # norms.py's rows per program
        fast(rms_norm_int8_kernel)[(cdiv(N, BT),)](
            x2, weight, q if y is None else y, q, s, x2.stride(0), N, D, eps, BT=BT, BD=BD, STORE_Y=keep_normed,
            num_warps=4 if BD <= 2048 else 8)
    return y, q, s


def rms_norm_int8(x: torch.Tensor, weight: torch.Tensor, eps: float, keep_normed: bool):
    """-> (rms_norm(x) or None, int8 codes [T, D], float32 scales [T]); see the module docstring."""
    if use_triton(x, weight):
        return rms_norm_int8_launch(x, weight, eps, keep_normed)
    return rms_norm_int8_ref(x, weight, eps, keep_normed)
