"""KDA chunked prefill over packed variable-length sequences, with state slots.

Kimi Delta Attention per head, with a per-channel decay ``g`` (log space) and a scalar ``beta``:
``S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (q_t / sqrt(K))``
with ``q`` and ``k`` L2-normalised. States are ``[K, V]`` float32 per head.

The reference is the chunked (WY) form: within a chunk of ``BT`` tokens the delta rule is solved as a
triangular system, and the state is carried from chunk to chunk. It reads each sequence's initial state
from its slot (or zeros for a sequence that starts here) and writes the final state back to the slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashinfra.kernels.kda_gate import l2norm_ref


def kda_chunk_one_ref(
    q: torch.Tensor,  # [L, H, K] float32, L2-normalised
    k: torch.Tensor,  # [L, H, K] float32, L2-normalised
    v: torch.Tensor,  # [L, H, V] float32
    g: torch.Tensor,  # [L, H, K] float32 log-decay
    beta: torch.Tensor,  # [L, H] float32
    state: torch.Tensor,  # [H, K, V] float32 initial state
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [L, H, V], final state [H, K, V]
    L, H, K = k.shape
    BT = chunk_size
    pad = (BT - L % BT) % BT
    # [H, N, BT, *]
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(H, -1, BT, x.shape[-1]) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).transpose(0, 1).reshape(H, -1, BT)
    q = q * K**-0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g = g.cumsum(-2)
    strict_upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=1)
    upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=0)
    # decay[i, j] = exp(g_i - g_j) for j <= i, per channel
    decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(strict_upper[..., None], float("-inf")).exp()
    A = -(k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(upper, 0)
    for i in range(1, BT):  # forward substitution: (I - A)^-1, row by row
        A[..., i, :i] = A[..., i, :i].clone() + (A[..., i, :i, None].clone() * A[..., :i, :i].clone()).sum(-2)
    A = A + torch.eye(BT, dtype=A.dtype, device=A.device)
    u = A @ v_beta  # [H, N, BT, V]
    w = A @ (k_beta * g.exp())  # [H, N, BT, K]
    o = torch.empty_like(u)
    S = state.clone()
    for n in range(u.shape[1]):
        q_n, k_n, g_n = q[:, n], k[:, n], g[:, n]
        qk = (q_n[..., :, None, :] * k_n[..., None, :, :] * decay[:, n]).sum(-1).masked_fill(strict_upper, 0)
        v_new = u[:, n] - w[:, n] @ S
        o[:, n] = (q_n * g_n.exp()) @ S + qk @ v_new
        S = S * g_n[:, -1, :, None].exp() + (k_n * (g_n[:, -1:] - g_n).exp()).transpose(-1, -2) @ v_new
    o = o.reshape(H, -1, o.shape[-1])[:, :L].transpose(0, 1)
    return o, S


def kda_prefill_ref(
    q: torch.Tensor,  # [T, H, K] any float dtype, not yet normalised
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, H, V]
    g: torch.Tensor,  # [T, H, K] float32 log-decay (see kda_gate)
    beta: torch.Tensor,  # [T, H] float32 in (0, 1)
    state: torch.Tensor,  # [num_slots, H, K, V] float32, final states written in place
    cu_seqlens: list[int],  # B + 1
    state_slots: list[int],  # [B]
    has_initial_state: list[bool],  # [B]
) -> torch.Tensor:  # [T, H, V] in q's dtype
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for b, slot in enumerate(state_slots):
        bos, eos = cu_seqlens[b], cu_seqlens[b + 1]
        s0 = state[slot].float() if has_initial_state[b] else state.new_zeros(state.shape[1:], dtype=torch.float32)
        o, s1 = kda_chunk_one_ref(
            l2norm_ref(q[bos:eos].float()),
            l2norm_ref(k[bos:eos].float()),
            v[bos:eos].float(),
            g[bos:eos].float(),
            beta[bos:eos].float(),
            s0,
        )
        out[bos:eos] = o.to(q.dtype)
        state[slot] = s1.to(state.dtype)
    return out


def kda_prefill(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state):
    return kda_prefill_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state)
