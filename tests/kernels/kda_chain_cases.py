"""The transition map's cases, shared by the CPU tests (references, the kernel under Triton's interpreter) and
the GPU ones: inputs with slow decay or at the gate's lower bound, the float64 truth, the error measure."""

from __future__ import annotations

import torch

from flashinfra.kernels.kda.ref import kda_gate_ref, l2norm_ref


def inputs(T: int, H: int, K: int, V: int, decay: str, device="cpu", seed: int = 0):
    """(k, v, g, beta, gate) float32: ``decay="slow"``: plain log-decay in (-0.02, 0); ``decay="long"``: log-decay
    in (-1e-5, 0) and beta near 0.0025, a state that remembers a whole 64k-token part (M far from 0 at its end);
    ``decay="bound"``: the gated form with lower bound -5 and decay rates up to 16 (many channels near the bound);
    ``gate`` is ``(g_raw, beta_logits, A_log, dt_bias, lower_bound)`` for the gated form, else None."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device)

    k, v = rand(T, H, K), rand(T, H, V)
    beta_logits = rand(T, H)
    if decay in ("slow", "long"):
        g = (-(0.02 if decay == "slow" else 1e-5) * torch.rand(T, H, K, generator=gen)).to(device)
        return k, v, g, torch.sigmoid(beta_logits - (6.0 if decay == "long" else 0.0)), None
    g_raw = rand(T, H, K)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log().to(device)
    dt_bias = rand(H * K, scale=0.5)
    g = kda_gate_ref(g_raw, A_log, dt_bias, -5.0)
    return k, v, g, torch.sigmoid(beta_logits), (g_raw, beta_logits, A_log, dt_bias, -5.0)


def token_product(k, g, beta) -> torch.Tensor:
    """M [H, K, K] of one sequence as the product of its token factors, in float64."""
    T, H, K = k.shape
    kn, a, b = l2norm_ref(k.double()), g.double().exp(), beta.double()
    eye = torch.eye(K, dtype=torch.float64, device=k.device)
    m = eye.expand(H, K, K).clone()
    for t in range(T):
        m = (eye - b[t, :, None, None] * kn[t, :, :, None] * kn[t, :, None, :]) * a[t, :, None, :] @ m
    return m


def rel_error(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-300) -> float:
    """Largest error over the largest magnitude of the float64 truth (or over ``floor`` where the truth is smaller:
    a float32 map at the gate's bound decays below float32's range within a few hundred tokens, e.g. 1e-196 after
    1000 tokens, where float32 can only hold 0)."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(floor)).item()
