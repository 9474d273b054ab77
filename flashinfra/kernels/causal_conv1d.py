"""Short causal depthwise conv1d with SiLU, over packed variable-length sequences, with its state.

The conv state of a sequence holds its last ``W - 1`` inputs (before the conv), so a later chunk or a
decode step continues exactly where the previous one stopped. The conv runs in the weight's dtype
(float32 in GLM-5.3-Flash) and its output is cast back to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_prefill_ref(
    x: torch.Tensor,  # [T, C] packed tokens
    weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    cu_seqlens: list[int],  # B + 1 offsets into T
    state_slots: list[int],  # [B] slot of each sequence
    has_initial_state: list[bool],  # [B] False: the sequence starts here, its history is zeros
) -> torch.Tensor:  # [T, C]
    C, W = weight.shape
    out = torch.empty_like(x)
    for b, slot in enumerate(state_slots):
        bos, eos = cu_seqlens[b], cu_seqlens[b + 1]
        history = conv_state[slot] if has_initial_state[b] else conv_state.new_zeros(C, W - 1)
        xs = torch.cat([history.to(x.dtype), x[bos:eos].t()], dim=-1)  # [C, W - 1 + L]
        y = F.conv1d(xs.to(weight.dtype)[None], weight[:, None, :], groups=C)[0]  # [C, L]
        out[bos:eos] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = xs[:, xs.shape[-1] - (W - 1) :].to(conv_state.dtype)
    return out


def causal_conv1d_decode_ref(
    x: torch.Tensor,  # [B, C] one token per sequence
    weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, C]
    xs = torch.cat([conv_state[state_slots].to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, W]
    y = (xs.to(weight.dtype) * weight[None]).sum(-1)
    conv_state[state_slots] = xs[:, :, 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


def causal_conv1d_prefill(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state):
    return causal_conv1d_prefill_ref(x, weight, conv_state, cu_seqlens, state_slots, has_initial_state)


def causal_conv1d_decode(x, weight, conv_state, state_slots):
    return causal_conv1d_decode_ref(x, weight, conv_state, state_slots)
