"""The GLM-5.3-Flash text model over a packed batch: embedding, mHC decoder layers, norm, head.

Every decoder layer is two hyper-connected sub-blocks: (input norm -> KDA or MLA) and
(post-attention norm -> dense MLP or MoE). The model is stateless: caches come in a ``ModelCache`` and
sequence layout in a ``ForwardBatch``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flashinfra.config import LINEAR_ATTENTION, TextConfig
from flashinfra.kernels.mhc import hc_collapse_norm, hc_embed
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.kda import KDAttention
from flashinfra.model.mhc import HyperConnection
from flashinfra.model.mla import MLAttention
from flashinfra.model.moe import DenseMLP, MoE
from flashinfra.quant.linear import linear


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.is_kda = cfg.layer_types[layer] == LINEAR_ATTENTION
        self.attn = KDAttention(cfg, layer, dtype) if self.is_kda else MLAttention(cfg, layer, dtype)
        self.mlp = (
            MoE(cfg, dtype)
            if cfg.mlp_layer_types[layer] == "sparse"
            else DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, dtype)
        )
        self.input_norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.attn_hc = HyperConnection(cfg, dtype)
        self.ffn_hc = HyperConnection(cfg, dtype)
        self.eps = cfg.rms_norm_eps

    def forward(self, streams, batch: ForwardBatch, cache: ModelCache, masks: dict,
                then: HyperConnection | None = None) -> torch.Tensor:
        """``then``: the next layer's first hyper-connection (``HyperConnection.forward``), or None."""
        # Each block takes its input normed with mHC's collapse, in the form the projection the norm feeds reads
        # (W8A8: int8 codes, ``rms_norm_for``); the projection is None where a parallel wrapper (flashinfra.parallel)
        # replaced the module: plain rows then. MLA's indexer and the MoE's router read the normed rows too.
        def attention(x):
            return self.attn(x, batch, cache) if self.is_kda else self.attn(x, batch, cache, masks)

        moe = isinstance(self.mlp, MoE)
        attn_proj = getattr(self.attn, "in_proj" if self.is_kda else "qkv_a_proj", None)
        mlp_proj = getattr(self.mlp, "w13" if moe else "gate_up_proj", None)
        streams = self.attn_hc(streams, attention, (self.input_norm, self.eps, attn_proj, not self.is_kda),
                               self.ffn_hc)
        return self.ffn_hc(streams, self.mlp, (self.post_attn_norm, self.eps, mlp_proj, moe), then)


class Glm5NextModel(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype, has_lm_head: bool):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
            if has_lm_head
            else None
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] packed -> final hidden states [T, D] (after the final norm). ``inputs_embeds`` [T, D]
        replaces the embedding lookup (images and video: ``flashinfra.multimodal.encoder``)."""
        n = self.cfg.hc_mult
        if inputs_embeds is None:
            streams = hc_embed(input_ids, self.embed_tokens, n)  # [T, n, D]
        else:
            streams = inputs_embeds.unsqueeze(1).expand(-1, n, -1).contiguous()
        masks: dict[int, list[torch.Tensor]] = {}
        for layer, after in zip(self.layers, [*self.layers[1:], None]):
            streams = layer(streams, batch, cache, masks, after.attn_hc if after is not None else None)
        return self.final_norm(streams)

    def final_norm(self, streams: torch.Tensor) -> torch.Tensor:
        """The last layer's streams [T, n, D] -> final hidden states [T, D]: collapse by mean, then norm."""
        return hc_collapse_norm(streams, self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return linear(hidden, head).float()
