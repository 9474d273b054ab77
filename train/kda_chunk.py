"""Chunked KDA for training without flash-linear-attention: transformers' PyTorch path, minus its row loop.

transformers' fallback ``chunk_kimi_delta_attention`` builds the intra-chunk inverse ``(I - A)^-1`` row by
row (63 Python iterations per chunk of 64, each a clone); this file computes the same matrix with one
``torch.linalg.solve_triangular`` and is otherwise the same computation, so it trains the same model.
fla-core's Triton kernels are faster per step but compile and autotune for minutes on their first call,
which costs more than a short training run gains. ``tests/test_default_model.py`` checks this function
against transformers' reference in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_kda(
    query: torch.Tensor,  # [B, T, H, K]
    key: torch.Tensor,  # [B, T, H, K]
    value: torch.Tensor,  # [B, T, H, V]
    g: torch.Tensor,  # [B, T, H, K] log decay
    beta: torch.Tensor,  # [B, T, H]
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,  # [B, H, K, V]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = query.dtype
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, beta, g = [x.transpose(1, 2).contiguous().to(compute) for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    B, H, T, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (C - T % C) % C
    q = F.pad(q, (0, 0, 0, pad)) * K**-0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v, g = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v, g))  # [B, H, N, C, *]
    beta = beta.reshape(B, H, N, C, 1)
    g = g.cumsum(dim=-2)

    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))  # j <= i
    strict = torch.tril(causal, diagonal=-1)  # j < i
    # decay[i, j, d] = exp(g_i - g_j) for j <= i; masked before exp so nothing overflows.
    diff = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(~causal[..., None], float("-inf"))
    decay = diff.exp()  # [B, H, N, C, C, K]
    k_beta = k * beta
    A = (k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1) * strict  # [B, H, N, C, C]
    eye = torch.eye(C, dtype=compute, device=q.device)
    inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    u = inv @ (v * beta)  # [B, H, N, C, V]
    w = inv @ (k_beta * g.exp())  # [B, H, N, C, K]
    qk = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)  # [B, H, N, C, C], causal incl. diagonal

    S = (
        torch.zeros(B, H, K, V, dtype=compute, device=q.device)
        if initial_state is None
        else initial_state.to(compute)
    )
    outs = []
    for n in range(N):
        g_n = g[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append((q[:, :, n] * g_n.exp()) @ S + qk[:, :, n] @ v_new)
        g_last = g_n[:, :, -1:]  # [B, H, 1, K]
        S = S * g_last.transpose(-1, -2).exp() + (k[:, :, n] * (g_last - g_n).exp()).transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(dtype), (S if output_final_state else None)
