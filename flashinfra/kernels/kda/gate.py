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


@triton.jit
def load_gate_beta(g, beta, A_log, dt_bias, lower_bound, rows, m_t, m_tk, i_h, o_k, m_k, stride_g_t, stride_b_t,
                   K: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, HAS_LOWER_BOUND: tl.constexpr,
                   BETA_LOGITS: tl.constexpr, G_MIN: tl.constexpr):
    """A head's log-decay (clamped below at ``G_MIN``, the chunk kernels' exactness bound) and beta for the
    token ``rows``, zero past the sequence's end; the gate and beta's sigmoid computed here from the raw
    projections (``GATE_IN_KERNEL``, ``BETA_LOGITS``) or read as given."""
    b_g = tl.load(g + rows[:, None] * stride_g_t + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_b = tl.load(beta + rows * stride_b_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    if GATE_IN_KERNEL:
        b_g = b_g + tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        b_g = kda_log_decay(b_g, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lower_bound, HAS_LOWER_BOUND)
    if BETA_LOGITS:
        b_b = tl.sigmoid(b_b)
    return tl.where(m_tk, tl.maximum(b_g, G_MIN), 0.0), tl.where(m_t, b_b, 0.0)
