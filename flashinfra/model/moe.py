"""Feed-forward layers: the dense SwiGLU MLP and the routed MoE with a shared expert.

Router: sigmoid scores (float32) plus ``e_score_correction_bias`` choose experts; group-limited choice
keeps the ``topk_group`` groups with the best top-2 sums; the chosen experts' unbiased scores are
normalised and scaled by ``routed_scaling_factor``. SwiGLU clamps the gate from above and the up
projection on both sides at ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flashinfra.config import TextConfig
from flashinfra.kernels.fused_moe import clamped_swiglu, experts_ref
from flashinfra.kernels.moe_route import route_aligned, route_ref
from flashinfra.quant.linear import Int8Rows, linear, moe_experts, normed

__all__ = ["DenseMLP", "MoE", "clamped_swiglu", "experts_ref", "route_ref"]


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(clamped_swiglu(linear(x, self.gate_up_proj), self.limit), self.down_proj)


class MoE(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.cfg = cfg
        self.router_weight = nn.Parameter(torch.empty(E, D, dtype=torch.float32), requires_grad=False)
        self.router_bias = nn.Parameter(torch.empty(E, dtype=torch.float32), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, D, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, D, I, dtype=dtype), requires_grad=False)
        self.shared = DenseMLP(D, I * cfg.n_shared_experts, cfg.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor | Int8Rows) -> torch.Tensor:
        """``x`` rows, or under W8A8 ``Int8Rows`` with the normed rows kept (the router's input)."""
        c = self.cfg
        w, ids, aligned = route_aligned(
            normed(x), self.router_weight, self.router_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )
        return moe_experts(x, self.w13, self.w2, w, ids, c.swiglu_limit, self.shared.gate_up_proj,
                           self.shared.down_proj, aligned)
