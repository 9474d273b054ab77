"""Pure-PyTorch references of the KDA ops, the float64-capable ground truth of the tests and checks.

Kimi Delta Attention per head, with a per-channel decay ``g`` (log space) and a scalar ``beta``:
``S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (q_t / sqrt(K))``
with ``q`` and ``k`` L2-normalised. The prefill reference is the chunked (WY) form: within a chunk the delta rule
is solved as a triangular system, and the state is carried from chunk to chunk. Each sequence reads its initial
state from its slot (zeros for a sequence that starts here) and writes its final state back. The gate is
``g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))`` (a scale, not a clamp), or without a lower bound
``-exp(A_log) * softplus(g_raw + dt_bias)``. Arithmetic is float32, or float64 where the inputs are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashinfra.kernels.kda.conv import causal_conv1d_decode_ref
from flashinfra.kernels.norms import gated_rms_norm_ref


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
    # a sequence shorter than a chunk is one chunk either way: padded to the next power of two (at least 16), not
    # to the chunk, the same sums over fewer zero rows
    BT = chunk_size if L >= chunk_size else min(chunk_size, max(16, 1 << (L - 1).bit_length()))
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
    eye = torch.eye(BT, dtype=A.dtype, device=A.device).expand_as(A)
    A = torch.linalg.solve_triangular(eye - A, eye, upper=False, unitriangular=True)  # (I - A)^-1
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


def kda_summary_ref(
    k: torch.Tensor,  # [T, H, K] not yet normalised
    v: torch.Tensor,  # [T, H, V]
    g: torch.Tensor,  # [T, H, K] log-decay
    beta: torch.Tensor,  # [T, H]
    cu_seqlens: list[int],  # B + 1
    segment: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # M [B, H, K, K], H [B, H, K, V] in float32, or float64 where k is
    """Each sequence's affine map ``S_out = M S_in + H``: the chunked reference carries ``[M | H]`` as one state
    of ``K + V`` columns from ``[I | 0]``, with values ``[0 | v]`` (the update is linear in the values, so the
    first columns see none), ``segment`` tokens at a time (its in-chunk decay tensor grows with the tokens it
    holds)."""
    T, H, K = k.shape
    V = v.shape[-1]
    ct = torch.promote_types(k.dtype, torch.float32)
    start = torch.cat([torch.eye(K, dtype=ct, device=k.device).expand(H, K, K),
                       torch.zeros(H, K, V, dtype=ct, device=k.device)], -1)
    out = []
    for bos, eos in zip(cu_seqlens, cu_seqlens[1:]):
        s = start.clone()
        for a in range(bos, eos, segment):
            e = min(a + segment, eos)
            kn = l2norm_ref(k[a:e].to(ct))
            vv = torch.cat([torch.zeros_like(kn), v[a:e].to(ct)], -1)
            _, s = kda_chunk_one_ref(kn, kn, vv, g[a:e].to(ct), beta[a:e].to(ct), s)
        out.append(s)
    both = torch.stack(out) if out else torch.empty(0, H, K, K + V, dtype=ct, device=k.device)
    return both[..., :K], both[..., K:]


def kda_transition_ref(
    k: torch.Tensor,  # [T, H, K] not yet normalised
    g: torch.Tensor,  # [T, H, K] log-decay
    beta: torch.Tensor,  # [T, H]
    cu_seqlens: list[int],  # B + 1
    segment: int = 1024,
) -> torch.Tensor:  # [B, H, K, K] in float32, or float64 where k is
    """Each sequence's transition map ``M`` alone (``kda_summary_ref`` without values)."""
    return kda_summary_ref(k, k[..., :0], g, beta, cu_seqlens, segment)[0]


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
    checkpoints=(),  # (seq, p, slot): slot also receives the state after p of seq's tokens (checkpoints.py)
) -> torch.Tensor:  # [T, H, V] in q's dtype
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for b, slot in enumerate(state_slots):
        bos, eos = cu_seqlens[b], cu_seqlens[b + 1]
        s = state[slot].float() if has_initial_state[b] else state.new_zeros(state.shape[1:], dtype=torch.float32)
        # the sequence runs in pieces cut at its checkpoints, each piece's chunks counted from its start
        cuts = sorted({int(p): int(dst) for n, p, dst in checkpoints if n == b}.items())
        start = 0
        for end, dst in [*cuts, (eos - bos, None)]:
            if end > start:
                rows = slice(bos + start, bos + end)
                o, s = kda_chunk_one_ref(l2norm_ref(q[rows].float()), l2norm_ref(k[rows].float()), v[rows].float(),
                                         g[rows].float(), beta[rows].float(), s)
                out[rows] = o.to(q.dtype)
            if dst is not None:
                state[dst] = s.to(state.dtype)
            start = end
        state[slot] = s.to(state.dtype)
    return out


def kda_prefill_gated_ref(
    q, k, v,
    g_raw: torch.Tensor,  # [T, H, K] f_b(f_a(x)) before the bias
    beta_logits: torch.Tensor,  # [T, H] b_proj(x)
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H * K]
    lower_bound: float | None,
    state, cu_seqlens, state_slots, has_initial_state, checkpoints=(),
) -> torch.Tensor:
    """``kda_prefill`` with the gate and beta computed from their raw projections."""
    g = kda_gate_ref(g_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logits.float())
    return kda_prefill_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, checkpoints)


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
    # float32 arithmetic, or float64 where q or the state is float64 (the tests' and checks' references)
    ct = torch.promote_types(torch.promote_types(q.dtype, state.dtype), torch.float32)
    q = l2norm_ref(q.to(ct)) * K**-0.5
    k = l2norm_ref(k.to(ct))
    S = state[state_slots].to(ct) * g.to(ct).exp()[..., None]  # [B, H, K, V]
    delta = (v.to(ct) - (S * k[..., None]).sum(-2)) * beta.to(ct)[..., None]  # [B, H, V]
    S = S + k[..., None] * delta[..., None, :]
    o = (S * q[..., None]).sum(-2)
    state[state_slots] = S.to(state.dtype)
    return o.to(dtype)


def kda_layer_decode_ref(
    qkv: torch.Tensor,  # [B, H*K + H*K + H*V] q|k|v before the conv, one token per sequence
    conv_weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1], updated in place
    g_raw: torch.Tensor,  # [B, H*K] f_b(f_a(x)) before the bias
    beta_logits: torch.Tensor,  # [B, H]
    gate: torch.Tensor,  # [B, H*V] output gate, before its sigmoid
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H*K]
    lower_bound: float | None,
    norm_weight: torch.Tensor,  # [V]
    eps: float,
    state: torch.Tensor,  # [num_slots, H, K, V], updated in place
    state_slots: torch.Tensor,  # [B] int
) -> torch.Tensor:  # [B, H, V] in qkv's dtype
    B = qkv.shape[0]
    H, K, V = state.shape[1:]
    y = causal_conv1d_decode_ref(qkv, conv_weight, conv_state, state_slots)
    q, k, v = y[:, : H * K].view(B, H, K), y[:, H * K : 2 * H * K].view(B, H, K), y[:, 2 * H * K :].view(B, H, V)
    g = kda_gate_ref(g_raw.view(B, H, K), A_log, dt_bias, lower_bound)
    o = kda_decode_ref(q, k, v, g, torch.sigmoid(beta_logits.float()), state, state_slots)
    return gated_rms_norm_ref(o, gate.view(B, H, V), norm_weight, eps)
