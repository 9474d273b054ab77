"""mHC (manifold-constrained hyper-connections): ``hc_mult`` residual streams per token.

Before each sub-block (attention or MLP) a one-layer projection of the normalised streams gives three
weights: ``pre`` collapses the streams into the block's input, ``post`` expands the block's output back
into streams, and ``comb`` (made doubly stochastic by Sinkhorn iterations) mixes the residual streams.
After the last layer the streams collapse by an unweighted mean.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashinfra.config import TextConfig
from flashinfra.kernels.norms import unweighted_rms_norm_ref


class HyperConnection(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        n = cfg.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (pre [T, n], post [T, n], comb [T, n, n]), all float32."""
        n = self.n
        flat = unweighted_rms_norm_ref(streams.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        return pre, post, comb

    def forward(self, streams: torch.Tensor, block) -> torch.Tensor:
        """Apply ``block`` (a function of the collapsed [T, D] input) as a hyper-connected sub-layer."""
        pre, post, comb = self.weights(streams)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        out = block(collapsed)  # [T, D]
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
