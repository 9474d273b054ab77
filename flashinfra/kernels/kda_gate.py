"""KDA input activations: the forget gate with its lower bound, beta, and the q/k L2 norm.

``g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`` (lower_bound is a scale, not a clamp); with
no lower bound the gate is ``-exp(A_log) * softplus(g_raw + dt_bias)``. All in float32, as the state is.
``kda_log_decay`` is the same formula inside a Triton kernel (the prefill and decode kernels fuse it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (eps inside the root, as KDA defines it)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate_ref(
    g_raw: torch.Tensor,  # [T, H, K] f_b(f_a(x)), any float dtype
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H * K]
    lower_bound: float | None,
) -> torch.Tensor:  # [T, H, K] float32 log-decay, <= 0
    T, H, K = g_raw.shape
    g = g_raw.float() + dt_bias.float().view(1, H, K)
    decay_rate = A_log.float().exp().view(1, H, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(decay_rate * g)
    return -decay_rate * F.softplus(g, threshold=20.0)


@triton.jit
def kda_log_decay(x, rate, lower_bound, HAS_LOWER_BOUND: tl.constexpr):
    """``kda_gate_ref`` on ``x = g_raw + dt_bias`` (float32) with ``rate = exp(A_log)``."""
    if HAS_LOWER_BOUND:
        return lower_bound * tl.sigmoid(rate * x)
    return -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
