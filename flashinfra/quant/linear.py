"""The projections' calls: ``linear`` and ``moe_experts`` dispatch on the weight's type; ``rms_norm_for`` is the
norm in front of a projection, in the form that projection reads.

A float tensor runs ``kernels.batch_invariant.linear`` (``F.linear``, or a fixed-tile GEMM in deterministic mode)
and ``kernels.fused_moe``; a ``QuantizedWeight`` runs its scheme's kernel op
(``linear_8bit`` and ``fused_moe`` with the weights' scales), each of which picks its Triton kernel or its
reference by ``dispatch.use_triton``.

MoE: a quantized shared expert of the routed experts' width and scheme (the quantizer stacks it as their last
expert, see ``flashinfra.quant.model``) runs as one more pair per token with weight 1 in the same launches, as
in bf16; otherwise it runs as a dense SwiGLU MLP beside them.

W8A8 projections fed by an RMSNorm (KDA's ``in_proj``, MLA's ``qkv_a_proj`` and ``q_b_proj``, a dense MLP's
``gate_up_proj``) read ``Int8Rows``: the norm's kernel quantizes its output per token in its epilogue
(``kernels.quant.rms_norm_int8``) and the GEMM takes the codes as they are, with the same codes and scales as
``linear_8bit`` would form from the normed rows, so the results are unchanged. So does the MoE's norm (its router
reads the normed rows), whose codes ``fused_moe`` takes for its first GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.kernels import batch_invariant
from flashinfra.kernels.fused_moe import clamped_swiglu, fused_moe
from flashinfra.kernels.norms import rms_norm
from flashinfra.kernels.quant import linear_8bit, matmul_8bit, rms_norm_int8
from flashinfra.quant.weights import QuantizedWeight


@dataclass(frozen=True)
class Int8Rows:
    """Rows [T, K] quantized per token to int8 by the kernel that produced them, for the W8A8 projections they feed:
    codes ``q`` int8 [T, K], scales ``s`` float32 [T], the projections' output ``dtype``, and ``normed`` the rows
    in that dtype where another consumer reads them (MLA's indexer), else None."""
    q: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype
    normed: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def is_w8a8(w) -> bool:
    return isinstance(w, QuantizedWeight) and w.scheme == "w8a8"


def rms_norm_for(x: torch.Tensor, weight: torch.Tensor, eps: float, proj, keep_normed: bool):
    """``rms_norm(x)`` as the projection ``proj`` reads it: ``Int8Rows`` where it is W8A8 (``keep_normed``: with
    the normed rows too, for a consumer other than ``proj``), else the normed rows."""
    if not is_w8a8(proj):
        return rms_norm(x, weight, eps)
    y, q, s = rms_norm_int8(x, weight, eps, keep_normed)
    return Int8Rows(q, s, x.dtype, y)


def normed(x: torch.Tensor | Int8Rows) -> torch.Tensor:
    """The rows in the model dtype (``Int8Rows`` made with ``keep_normed``)."""
    return x.normed if isinstance(x, Int8Rows) else x


def linear(x: torch.Tensor | Int8Rows, w: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(x, Int8Rows):
        if not is_w8a8(w):
            raise TypeError("linear: int8 rows feed W8A8 weights only")
        return matmul_8bit(x.q, x.s, w.data, w.scale, bias, w.block, x.dtype)
    if not isinstance(w, QuantizedWeight):
        return batch_invariant.linear(x, w, bias)
    return linear_8bit(x, w.data, w.scale, bias, w.block)


def shared_is_grouped(w13: QuantizedWeight, shared_w13, shared_w2) -> bool:
    """The shared expert can run in the routed experts' launches: quantized alike, of one routed expert's shape."""
    return (isinstance(shared_w13, QuantizedWeight) and isinstance(shared_w2, QuantizedWeight)
            and shared_w13.scheme == w13.scheme and shared_w13.data.shape == w13.data.shape[1:])


def moe_experts(x, w13, w2, topk_weights, topk_ids, limit: float, shared_w13, shared_w2,
                aligned=None) -> torch.Tensor:
    """Routed experts plus the shared expert, as ``fused_moe``; ``x`` rows, or ``Int8Rows`` kept with their normed
    rows (W8A8 experts); ``aligned``: the router's alignment of the pairs (``moe_route.route_aligned``)."""
    rows, x = x, normed(x)
    codes = (rows.q, rows.s) if isinstance(rows, Int8Rows) else None
    if not isinstance(w13, QuantizedWeight):
        return fused_moe(x, w13, w2, topk_weights, topk_ids, limit, shared_w13, shared_w2, aligned=aligned)
    if shared_is_grouped(w13, shared_w13, shared_w2):
        return fused_moe(x, w13.data, w2.data, topk_weights, topk_ids, limit, shared_w13.data, shared_w2.data,
                         (w13.scale, w2.scale, shared_w13.scale, shared_w2.scale), codes, aligned)
    shared = linear(clamped_swiglu(linear(rows, shared_w13), limit), shared_w2)
    return fused_moe(x, w13.data, w2.data, topk_weights, topk_ids, limit, None, None,
                     (w13.scale, w2.scale, None, None), codes, aligned) + shared
