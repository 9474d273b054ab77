"""DSA lightning indexer with k-pool compression: which cached tokens each query attends to.

Per token the indexer caches a key (``LayerNorm(wk x)``) and a gate score (``Wg x``). Every complete pool
of ``kpool`` consecutive tokens is compressed into one key: a softmax over the pool's tokens (per channel,
of gate score + a learned per-position bias) weights their keys. A query scores each pool with
``sum_h w_h * relu(q_h . k_pool / sqrt(d))`` and keeps the best ``index_topk / kpool`` pools whose last
token it can see (causality over the cached tokens); the incomplete tail pool (the last
``(pos + 1) % kpool`` tokens) is always kept. The result is a boolean ``[L, N]`` mask per sequence.

Ties (pools whose every head scores ReLU 0 tie at exactly 0) go to the more recent pool. transformers'
``topk`` leaves ties to its sort order, which changes with the number of pools in the tensor, so there a
query's selection differs between a full prefill, a chunk and a decode step; here it never does.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashinfra.config import TextConfig
from flashinfra.kernels.batch_invariant import linear
from flashinfra.kernels.dsa_pool_keys import compress_pools


class Indexer(nn.Module):
    K_NORM_EPS = 1e-6  # the key LayerNorm's

    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        Hi, Di, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
        self.Hi, self.Di = Hi, Di
        self.kpool, self.topk, self.keep_tail = cfg.index_kpool, cfg.index_topk, cfg.index_kpool_always_select_tail
        self.splits = [Di, Di, Hi]  # key, pool gate score, head weights

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.x_proj = param(sum(self.splits), D)  # wk | index_kpool_compress_gate | weights_proj
        self.wq_b = param(Hi * Di, cfg.q_lora_rank)
        self.k_norm_weight = param(Di)
        self.k_norm_bias = param(Di)
        self.pool_ape = param(self.kpool, Di)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (key | gate score [T, 2 Di] before the key's norm (``entries_of``), queries [T, Hi, Di], head weights
        [T, Hi] float32)."""
        kg, w = linear(x, self.x_proj).split([2 * self.Di, self.Hi], dim=-1)
        q = linear(q_resid, self.wq_b).view(-1, self.Hi, self.Di)
        return kg, q, w.float() * self.Hi**-0.5

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """The cache entries [T, 2 Di] of ``x`` alone."""
        return self.entries_of(linear(x, self.x_proj[: 2 * self.Di]))

    def entries_of(self, kg: torch.Tensor) -> torch.Tensor:
        """Key | gate score rows -> the cache entries: the key LayerNorm-ed, the gate score as it is."""
        k, gate = kg.split(self.Di, dim=-1)
        k = F.layer_norm(k, (self.Di,), self.k_norm_weight, self.k_norm_bias, eps=self.K_NORM_EPS)
        return torch.cat([k, gate], dim=-1)

    def select(
        self,
        entries: torch.Tensor,  # [N, 2 Di] this sequence's cached entries, new tokens included
        q: torch.Tensor,  # [L, Hi, Di] the sequence's new queries (the last L of its N tokens)
        head_weights: torch.Tensor,  # [L, Hi] float32
    ) -> torch.Tensor:  # [L, N] bool
        N, L, kp = entries.shape[0], q.shape[0], self.kpool
        P = N // kp
        pool_keys = compress_pools(entries[: P * kp].view(P, kp, 2 * self.Di), self.pool_ape)  # [P, Di]
        scores = F.relu(torch.matmul(q.float(), pool_keys.float().t()) * self.Di**-0.5)  # [L, Hi, P]
        index_scores = torch.matmul(head_weights.unsqueeze(-2), scores).squeeze(-2)  # [L, P]
        q_pos = torch.arange(N - L, N, device=q.device)
        pool_end = torch.arange(P, device=q.device) * kp + kp - 1
        visible = pool_end[None, :] <= q_pos[:, None]  # [L, P]
        index_scores = index_scores.masked_fill(~visible, torch.finfo(index_scores.dtype).min)
        chosen = top_pools(index_scores, min(self.topk // kp, P))  # [L, k]
        pool_mask = torch.zeros(L, P, dtype=torch.bool, device=q.device)
        pool_mask.scatter_(1, chosen, visible.gather(1, chosen))
        mask = torch.zeros(L, N, dtype=torch.bool, device=q.device)
        mask[:, : P * kp] = pool_mask.repeat_interleave(kp, dim=1)
        if self.keep_tail and kp > 1:
            pos = torch.arange(N, device=q.device)
            tail_start = q_pos + 1 - (q_pos + 1) % kp
            mask |= (pos[None, :] >= tail_start[:, None]) & (pos[None, :] <= q_pos[:, None])
        return mask


def top_pools(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` best pools per row, ties going to the higher (more recent) index."""
    P = scores.shape[-1]
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    return P - 1 - order
