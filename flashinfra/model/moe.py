"""Feed-forward layers: the dense SwiGLU MLP and the routed MoE with a shared expert.

Router: sigmoid scores (float32) plus ``e_score_correction_bias`` choose experts; group-limited choice
keeps the ``topk_group`` groups with the best top-2 sums; the chosen experts' unbiased scores are
normalised and scaled by ``routed_scaling_factor``. SwiGLU clamps the gate from above and the up
projection on both sides at ``swiglu_limit``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashinfra.config import TextConfig


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(clamped_swiglu(F.linear(x, self.gate_up_proj), self.limit), self.down_proj)


def route_ref(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [E, D] float32
    bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k] int64
    E = weight.shape[0]
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    choice = choice.masked_fill(~group_mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids


def experts_ref(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    limit: float,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        h = F.linear(clamped_swiglu(F.linear(x[token], w13[e]), limit), w2[e])
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(out.dtype))
    return out


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        w, ids = route_ref(
            x, self.router_weight, self.router_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )
        return experts_ref(x, self.w13, self.w2, w, ids, c.swiglu_limit) + self.shared(x)
