"""The clamped SwiGLU of GLM-5.3-Flash's dense MLPs (the vision tower's): ``silu(min(gate, limit)) *
clamp(up, -limit, limit)`` over the output of one fused gate|up GEMM ``[T, 2 * I]``.

The reference is ``fused_moe.clamped_swiglu`` (the experts' activation, which the MoE kernels fuse into their
first GEMM). The kernel reads ``gate_up`` once and writes ``[T, I]`` once, in float32 registers, rounding once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.fused_moe import clamped_swiglu as clamped_swiglu_ref
from flashinfra.kernels.launch import cdiv, fast

BI = 1024  # columns per program


@triton.jit
def clamped_swiglu_kernel(gu, y, I, limit, BI: tl.constexpr):
    i_t, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BI + tl.arange(0, BI)
    m = o_c < I
    b_g = tl.load(gu + i_t * 2 * I + o_c, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(gu + i_t * 2 * I + I + o_c, mask=m, other=0.0).to(tl.float32)
    b_g = tl.minimum(b_g, limit)
    b_u = tl.minimum(tl.maximum(b_u, -limit), limit)
    tl.store(y + i_t * I + o_c, (b_g * tl.sigmoid(b_g) * b_u).to(y.dtype.element_ty), mask=m)


def clamped_swiglu_launch(gate_up: torch.Tensor, limit: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [..., 2 * I] -> [..., I]."""
    I = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, 2 * I).contiguous()
    y = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    if y.shape != (*gate_up.shape[:-1], I) or y.dtype != gate_up.dtype or not y.is_contiguous():
        raise ValueError(f"clamped_swiglu: out must be contiguous {(*gate_up.shape[:-1], I)} {gate_up.dtype}")
    if x.shape[0]:
        fast(clamped_swiglu_kernel)[(x.shape[0], cdiv(I, BI))](x, y, I, float(limit), BI=BI, num_warps=4)
    return y


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    if use_triton(gate_up):
        return clamped_swiglu_launch(gate_up, limit)
    return clamped_swiglu_ref(gate_up, limit)
