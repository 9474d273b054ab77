"""mHC (manifold-constrained hyper-connections): ``hc_mult`` residual streams per token.

Before each sub-block (attention or MLP) a one-layer projection of the normalised streams gives three
weights: ``pre`` collapses the streams into the block's input, ``post`` expands the block's output back
into streams, and ``comb`` (made doubly stochastic by Sinkhorn iterations) mixes the residual streams.
After the last layer the streams collapse by an unweighted mean.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flashinfra.config import TextConfig
from flashinfra.kernels.mhc import hc_pre, hc_pre_norm, hc_weights_ref
from flashinfra.kernels.mhc_expand import hc_post
from flashinfra.quant.linear import Int8Rows, is_w8a8


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
        return hc_weights_ref(streams, self.fn, self.base, self.scale, self.n, self.iters, self.eps, self.norm_eps)

    def forward(self, streams: torch.Tensor, block, norm: tuple | None = None,
                then: HyperConnection | None = None) -> torch.Tensor:
        """Apply ``block`` (a function of the collapsed [T, D] input) as a hyper-connected sub-layer. ``norm``: the
        block's input RMSNorm (weight, eps) and the projection the normed rows feed and whether another consumer
        reads them (``rms_norm_for``'s ``proj`` and ``keep_normed``); ``block`` then takes the rows in the form
        ``rms_norm_for`` gives, normed with the collapse (one kernel for a decode step's token). ``then``: the
        hyper-connection the new streams go to next, whose mix product the expand forms for a decode batch."""
        next_fn = then.fn if then is not None else None
        if norm is None:
            x, post, comb = hc_pre(streams, self.fn, self.base, self.scale, self.n, self.iters, self.eps,
                                   self.norm_eps)
            return hc_post(streams, block(x), post, comb, next_fn)
        weight, eps, proj, keep_normed = norm
        codes = is_w8a8(proj)
        y, q, s, post, comb = hc_pre_norm(streams, self.fn, self.base, self.scale, self.n, self.iters, self.eps,
                                          self.norm_eps, weight, eps, codes, keep_normed)
        return hc_post(streams, block(Int8Rows(q, s, streams.dtype, y) if codes else y), post, comb, next_fn)
