"""The projections' calls: ``linear`` and ``moe_experts`` dispatch on the weight's type.

A float tensor runs ``kernels.batch_invariant.linear`` (``F.linear``, or a fixed-tile GEMM in deterministic mode)
and ``kernels.fused_moe``; a ``QuantizedWeight`` runs its scheme's
kernel op (``w8a8_linear`` / ``fp8_block_linear``, ``w8a8_moe`` / ``fp8_moe``), each of which picks its Triton
kernel or its reference by ``dispatch.use_triton``.

MoE: when the quantizer stacked the shared expert as the last expert of the routed weights (same width, see
``flashinfra.quant.model``), it runs as one more pair per token with weight 1 in the same launches, as
``fused_moe`` does in bf16; otherwise it runs as a dense SwiGLU MLP beside them.
"""

from __future__ import annotations

import torch

from flashinfra.kernels import batch_invariant
from flashinfra.kernels.fused_moe import clamped_swiglu, fused_moe
from flashinfra.kernels.quant import fp8_block_linear, fp8_moe, w8a8_linear, w8a8_moe
from flashinfra.quant.weights import QuantizedWeight


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(w, QuantizedWeight):
        return batch_invariant.linear(x, w, bias)
    if w.scheme == "w8a8":
        return w8a8_linear(x, w.data, w.scale, bias)
    return fp8_block_linear(x, w.data, w.scale, w.block, bias)


def shared_is_stacked(w13: QuantizedWeight, shared_w13) -> bool:
    """The shared expert's weights are the routed weights' last expert (one storage, no copy)."""
    return (isinstance(shared_w13, QuantizedWeight) and shared_w13.data.dim() == 2
            and shared_w13.data.data_ptr() == w13.data[-1].data_ptr())


def moe_experts(x, w13, w2, topk_weights, topk_ids, limit: float, shared_w13, shared_w2) -> torch.Tensor:
    """Routed experts plus the shared expert, as ``fused_moe``."""
    if not isinstance(w13, QuantizedWeight):
        return fused_moe(x, w13, w2, topk_weights, topk_ids, limit, shared_w13, shared_w2)
    experts = w8a8_moe if w13.scheme == "w8a8" else fp8_moe
    if shared_is_stacked(w13, shared_w13):
        T = x.shape[0]
        ids = torch.cat([topk_ids.to(torch.int32),
                         torch.full((T, 1), w13.shape[0] - 1, dtype=torch.int32, device=x.device)], 1)
        pair_w = torch.cat([topk_weights.float(), torch.ones(T, 1, device=x.device)], 1)
        return experts(x, w13.data, w13.scale, w2.data, w2.scale, pair_w, ids, limit)
    shared = linear(clamped_swiglu(linear(x, shared_w13), limit), shared_w2)
    return experts(x, w13.data, w13.scale, w2.data, w2.scale, topk_weights, topk_ids, limit) + shared
