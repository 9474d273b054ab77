"""The projections' calls: ``linear`` and ``moe_experts`` dispatch on the weight's type.

A float tensor runs ``kernels.batch_invariant.linear`` (``F.linear``, or a fixed-tile GEMM in deterministic mode)
and ``kernels.fused_moe``; a ``QuantizedWeight`` runs its scheme's kernel op
(``linear_8bit`` and ``fused_moe`` with the weights' scales), each of which picks its Triton kernel or its
reference by ``dispatch.use_triton``.

MoE: a quantized shared expert of the routed experts' width and scheme (the quantizer stacks it as their last
expert, see ``flashinfra.quant.model``) runs as one more pair per token with weight 1 in the same launches, as
in bf16; otherwise it runs as a dense SwiGLU MLP beside them.
"""

from __future__ import annotations

import torch

from flashinfra.kernels import batch_invariant
from flashinfra.kernels.fused_moe import clamped_swiglu, fused_moe
from flashinfra.kernels.quant import linear_8bit
from flashinfra.quant.weights import QuantizedWeight


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(w, QuantizedWeight):
        return batch_invariant.linear(x, w, bias)
    return linear_8bit(x, w.data, w.scale, bias, w.block)


def shared_is_grouped(w13: QuantizedWeight, shared_w13, shared_w2) -> bool:
    """The shared expert can run in the routed experts' launches: quantized alike, of one routed expert's shape."""
    return (isinstance(shared_w13, QuantizedWeight) and isinstance(shared_w2, QuantizedWeight)
            and shared_w13.scheme == w13.scheme and shared_w13.data.shape == w13.data.shape[1:])


def moe_experts(x, w13, w2, topk_weights, topk_ids, limit: float, shared_w13, shared_w2) -> torch.Tensor:
    """Routed experts plus the shared expert, as ``fused_moe``."""
    if not isinstance(w13, QuantizedWeight):
        return fused_moe(x, w13, w2, topk_weights, topk_ids, limit, shared_w13, shared_w2)
    if shared_is_grouped(w13, shared_w13, shared_w2):
        return fused_moe(x, w13.data, w2.data, topk_weights, topk_ids, limit, shared_w13.data, shared_w2.data,
                         (w13.scale, w2.scale, shared_w13.scale, shared_w2.scale))
    shared = linear(clamped_swiglu(linear(x, shared_w13), limit), shared_w2)
    return fused_moe(x, w13.data, w2.data, topk_weights, topk_ids, limit, None, None,
                     (w13.scale, w2.scale, None, None)) + shared
