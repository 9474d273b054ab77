"""RMSNorm flavours of GLM-5.3-Flash, as references.

- ``rms_norm``: normalise in float32, cast back, then scale by the weight (in the input dtype).
- ``gated_rms_norm``: the KDA output norm, entirely in float32, times ``sigmoid(gate)``, cast back.
- ``unweighted_rms_norm``: the mHC input norm (no weight).
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def unweighted_rms_norm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm(x, weight, eps):
    return rms_norm_ref(x, weight, eps)


def gated_rms_norm(x, gate, weight, eps):
    return gated_rms_norm_ref(x, gate, weight, eps)
