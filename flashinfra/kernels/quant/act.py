"""Dynamic activation quantization: per token to int8 (W8A8), per token and 128 channels to e4m3 (block FP8).

- ``quant_int8_per_token``: ``x`` [T, K] -> (int8 [T, K], float32 scale [T]) with ``scale = amax / 127`` and
  ``q = round(x / scale)`` (ties away from zero; an all-zero row gets scale 1).
- ``quant_fp8_per_group``: ``x`` [T, K] -> (e4m3 [T, K], float32 scale [T, ceil(K / G)]) with
  ``scale = amax / 448`` per group of ``G`` channels.

``quant_act`` / ``quant_act_ref`` pick the one an 8-bit weight format reads (``WEIGHT_FORMATS``: the weight's
dtype names it), for the 8-bit GEMMs (``gemm``) and the fused MoE (``kernels.fused_moe``).

One program per row (int8) or per (row, group) (fp8); the row is read twice (amax, then quantize), which for
the widths here stays in L2. The ``*_ref`` functions compute the same arithmetic in float32 with the same
operation order, so that the kernel matches them bit for bit except at exact rounding ties.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait

INT8_MAX = 127.0
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
GROUP = 128  # fp8 scales' block: weights per 128 x 128 tile, activations per 128 channels
# an 8-bit weight's element type -> its format, which the kernels take as a constexpr (float weights: none)
WEIGHT_FORMATS = {torch.int8: "int8", FP8_DTYPE: "fp8"}
# Widest row ``quant_int8_kernel`` holds in one tile (32 values a thread over 16 warps); wider rows take two passes.
WHOLE_ROW = 16384


def quant_int8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    v = xf * (1.0 / scale)[:, None]
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quant_fp8_per_group_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = x.shape
    G = cdiv(K, group)
    xf = torch.nn.functional.pad(x.float(), (0, G * group - K)).view(T, G, group)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf * (1.0 / scale)[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(T, G * group)[:, :K].contiguous(), scale


@triton.jit
def int8_codes(v):
    """Values already multiplied by their scale's reciprocal -> int8 codes: rounded half away from zero, clamped to
    +-127 (every int8 producer forms its codes here, so that they agree bit for bit)."""
    r = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


@triton.jit
def int8_scale(amax):
    """Per-token int8 scales from the rows' absolute maxima (1 for an all-zero row)."""
    return tl.where(amax > 0, amax / 127.0, 1.0)


@triton.jit
def int8_rows(b_f):
    """Rows [R, C] in registers (float32; masked columns zero, which leave the amax alone) -> (int8 codes, scales
    [R]), as ``quant_int8_per_token`` forms them: the producers that hold whole rows form them here."""
    scale = int8_scale(tl.max(tl.abs(b_f), 1))
    return int8_codes(b_f * (1.0 / scale)[:, None]), scale


@triton.jit
def quant_int8_kernel(x, q, s, K, stride_x, BK: tl.constexpr, WHOLE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    if WHOLE:  # the row in one tile: one load (a decode step's rows, up to 16,384 wide)
        o_k = tl.arange(0, BK)
        b_x = tl.load(x + i_t * stride_x + o_k, mask=o_k < K, other=0.0).to(tl.float32)
        scale = int8_scale(tl.max(tl.abs(b_x), 0))
        tl.store(q + i_t * K + o_k, int8_codes(b_x * (1.0 / scale)), mask=o_k < K)
    else:
        amax = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            b_x = tl.load(x + i_t * stride_x + o_k, mask=o_k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(b_x))
        scale = int8_scale(tl.max(amax, 0))
        inv = 1.0 / scale
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            b_x = tl.load(x + i_t * stride_x + o_k, mask=o_k < K, other=0.0).to(tl.float32)
            tl.store(q + i_t * K + o_k, int8_codes(b_x * inv), mask=o_k < K)
    tl.store(s + i_t, scale)


@triton.jit
def quant_fp8_kernel(x, q, s, K, G, stride_x, GROUP: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_k = i_g * GROUP + tl.arange(0, GROUP)
    b_x = tl.load(x + i_t * stride_x + o_k, mask=o_k < K, other=0.0).to(tl.float32)
    m = tl.max(tl.abs(b_x), 0)
    scale = tl.where(m > 0, m / 448.0, 1.0)
    v = tl.minimum(tl.maximum(b_x * (1.0 / scale), -448.0), 448.0)
    tl.store(q + i_t * K + o_k, v.to(q.dtype.element_ty), mask=o_k < K)
    tl.store(s + i_t * G + i_g, scale)


def quant_int8_per_token_launch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(T, K, dtype=torch.int8, device=x.device)
    s = torch.empty(T, dtype=torch.float32, device=x.device)
    if T:
        BK = min(WHOLE_ROW, next_power_of_2(K))
        fast(quant_int8_kernel)[(T,)](x, q, s, K, x.stride(0), BK=BK, WHOLE=BK >= K,
                                      num_warps=4 if BK <= 2048 else 8 if BK <= 8192 else 16)
    return q, s


def quant_fp8_per_group_launch(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    G = cdiv(K, group)
    q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    if T:
        fast(quant_fp8_kernel)[(T, G)](x, q, s, K, G, x.stride(0), GROUP=group, num_warps=4)
    return q, s


def quant_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return quant_int8_per_token_launch(x)
    return quant_int8_per_token_ref(x)


def quant_fp8_per_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return quant_fp8_per_group_launch(x, group)
    return quant_fp8_per_group_ref(x, group)


def quant_act(fmt: str, x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations as the ``fmt`` ("int8" or "fp8") GEMMs read them: (codes, float32 scales)."""
    return quant_int8_per_token(x) if fmt == "int8" else quant_fp8_per_group(x, group)


def quant_act_ref(fmt: str, x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_int8_per_token_ref(x) if fmt == "int8" else quant_fp8_per_group_ref(x, group)
