"""KDA decode: one token per sequence, the recurrent state read from and written back to its slot.

Same recurrence as ``kda_prefill`` (see there), one step: decay, delta-rule update, read-out.
"""

from __future__ import annotations

import torch

from flashinfra.kernels.kda_gate import l2norm_ref


def kda_decode_ref(
    q: torch.Tensor,  # [B, H, K] not yet normalised
    k: torch.Tensor,  # [B, H, K]
    v: torch.Tensor,  # [B, H, V]
    g: torch.Tensor,  # [B, H, K] float32 log-decay
    beta: torch.Tensor,  # [B, H] float32
    state: torch.Tensor,  # [num_slots, H, K, V], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, H, V] in q's dtype
    K, dtype = q.shape[-1], q.dtype
    q = l2norm_ref(q.float()) * K**-0.5
    k = l2norm_ref(k.float())
    S = state[state_slots].float() * g.float().exp()[..., None]  # [B, H, K, V]
    delta = (v.float() - (S * k[..., None]).sum(-2)) * beta.float()[..., None]  # [B, H, V]
    S = S + k[..., None] * delta[..., None, :]
    o = (S * q[..., None]).sum(-2)
    state[state_slots] = S.to(state.dtype)
    return o.to(dtype)


def kda_decode(q, k, v, g, beta, state, state_slots):
    return kda_decode_ref(q, k, v, g, beta, state, state_slots)
