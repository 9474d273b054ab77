"""The MTP (NextN) draft block: one MLA/DSA attention + MoE decoder layer without mHC, stored as layer
``num_hidden_layers`` (45 in the release).

Input per token: ``eh_proj(enorm(embed(next token)) ‖ hnorm(target hidden))`` where the target hidden is
the target model's final hidden state: the **mean over the mHC streams, then the final norm**
(``Glm5NextModel.final_norm``; handing over a single stream or the flattened streams is the failure that
drives acceptance to zero). The block then runs input norm -> MLA (its own latent and indexer caches,
keyed by its layer index) -> residual -> post-attention norm -> MoE -> residual. Its logits use
``shared_head.norm`` and the target's ``lm_head``; embeddings are the target's too. A chained draft feeds
the block's output hidden (before ``shared_head.norm``) back in as the next step's "target hidden".

transformers 5.24 does not implement this block (``Glm5NextForConditionalGeneration`` ignores
``layers.45.*`` on load, and ``save_pretrained`` writes none), so the tiny-model factory writes these
tensors itself, in the release names below (DeepSeek-V3 NextN naming):

    layers.N.{enorm,hnorm}.weight, layers.N.eh_proj.weight [D, 2D], layers.N.shared_head.norm.weight,
    layers.N.{input_layernorm,post_attention_layernorm}.weight, layers.N.self_attn.* (MLA + indexer),
    layers.N.mlp.* (MoE: gate, experts, shared_experts).

Copies of the embedding (``layers.N.embed_tokens.weight``) and head (``layers.N.shared_head.head.weight``)
may be stored too; they are the target's and are not read.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from flashinfra.config import INDEXED_ATTENTION, ModelConfig, TextConfig
from flashinfra.kernels.batch_invariant import linear
from flashinfra.kernels.norms import rms_norm
from flashinfra.model.cache import ModelCache, pool_keys
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.loader import CheckpointError, TensorSource, match_copies, read_tensor, weight_block
from flashinfra.model.mla import MLAttention
from flashinfra.model.moe import MoE
from flashinfra.model.weights import Copy, Form, _mla, _mlp

# tensors of the MTP layer that duplicate the target's (embedding, head): recognised, never read
SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_text_config(cfg: TextConfig) -> TextConfig:
    """The text config extended by the MTP layer (index ``num_hidden_layers``): a full-indexer MLA layer
    with an MoE, so the trunk's MLA and MoE modules and weight layouts serve it unchanged."""
    return dataclasses.replace(
        cfg,
        num_hidden_layers=cfg.num_hidden_layers + 1,
        layer_types=cfg.layer_types[: cfg.num_hidden_layers] + (INDEXED_ATTENTION,),
        mlp_layer_types=cfg.mlp_layer_types[: cfg.num_hidden_layers] + ("sparse",),
        indexer_types=cfg.indexer_types[: cfg.num_hidden_layers] + ("full",),
    )


class MTPBlock(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype):
        super().__init__()
        ext = mtp_text_config(cfg)
        self.layer = cfg.num_hidden_layers
        self.eps = cfg.rms_norm_eps
        D = cfg.hidden_size

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.enorm, self.hnorm, self.head_norm = param(D), param(D), param(D)
        self.eh_proj = param(D, 2 * D)
        self.input_norm, self.post_attn_norm = param(D), param(D)
        self.attn = MLAttention(ext, self.layer, dtype)
        self.mlp = MoE(ext, dtype)

    def assemble(self, embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """embeds [T, D] (embedding of the token after each position), target_hidden [T, D] (the target's
        final hidden: stream mean, then final norm) -> the block's input [T, D]."""
        e = rms_norm(embeds, self.enorm, self.eps)
        h = rms_norm(target_hidden, self.hnorm, self.eps)
        return linear(torch.cat([e, h], dim=-1), self.eh_proj)

    @torch.inference_mode()
    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, batch: ForwardBatch,
                cache: ModelCache) -> torch.Tensor:
        """-> the block's output hidden [T, D] (before ``shared_head.norm``); the chain's next input."""
        x = self.assemble(embeds, target_hidden)
        x = x + self.attn(rms_norm(x, self.input_norm, self.eps), batch, cache, {})
        return x + self.mlp(rms_norm(x, self.post_attn_norm, self.eps))

    def logits_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output hidden -> the hidden the shared ``lm_head`` reads."""
        return rms_norm(hidden, self.head_norm, self.eps)


def allocate_mtp_cache(cfg: TextConfig, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype,
                       device: torch.device | str) -> ModelCache:
    """The MTP layer's own paged latent and indexer-key caches (same block tables as the target)."""
    N = cfg.num_hidden_layers

    def paged(width: int) -> torch.Tensor:
        return torch.zeros(num_blocks, block_size, width, dtype=dtype, device=device)

    return ModelCache(block_size=block_size, num_blocks=num_blocks, num_slots=num_slots,
                      mla_latent={N: paged(cfg.kv_lora_rank)}, indexer_keys={N: paged(2 * cfg.index_head_dim)},
                      conv_state={}, recurrent_state={},
                      indexer_pool_keys={N: pool_keys(cfg, num_blocks, block_size, dtype, device)})


def mtp_weight_layout(cfg: TextConfig, params: dict[str, torch.Tensor], prefix: str) -> dict[str, list[Form]]:
    """Every parameter of ``MTPBlock`` -> its checkpoint forms (release names)."""
    ext, N, D = mtp_text_config(cfg), cfg.num_hidden_layers, cfg.hidden_size
    p = f"{prefix}layers.{N}."
    out: dict[str, list[Form]] = {}
    for ours, theirs in (("enorm", "enorm.weight"), ("hnorm", "hnorm.weight"), ("head_norm", "shared_head.norm.weight"),
                         ("input_norm", "input_layernorm.weight"),
                         ("post_attn_norm", "post_attention_layernorm.weight")):
        out[ours] = [[Copy(p + theirs, (), (D,))]]
    out["eh_proj"] = [[Copy(p + "eh_proj.weight", (), (D, 2 * D))]]
    out.update(_mla(p, ext, params, "attn.", N))
    out.update(_mlp(p, ext, params, "mlp.", N))
    missing = set(params) - set(out)
    if missing:
        raise AssertionError(f"MTP weight layout lacks parameters {sorted(missing)}")
    return out


def has_mtp(cfg: ModelConfig, names: set[str]) -> bool:
    return any(n.startswith(f"{cfg.weight_prefix}layers.{cfg.text.num_hidden_layers}.") for n in names)


def load_mtp(block: MTPBlock, cfg: ModelConfig, reader: TensorSource) -> int:
    """Read the MTP layer's tensors into ``block``, strictly: any missing, mis-shaped or unrecognised
    tensor under ``layers.N.`` is an error naming every one. Returns the number of tensors read."""
    params = dict(block.named_parameters())
    layout = mtp_weight_layout(cfg.text, params, cfg.weight_prefix)
    p = f"{cfg.weight_prefix}layers.{cfg.text.num_hidden_layers}."
    names = {n for n in reader.names() if n.startswith(p)}
    fp8_block = weight_block(cfg)
    plan, missing, misshaped, consumed = match_copies(layout, names, reader)
    consumed |= {p + s for s in SHARED_COPIES} & names
    unexpected = sorted(names - consumed)
    if missing or misshaped or unexpected:
        lines = ["checkpoint's MTP layer does not match the MTP block:"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  mis-shaped: {n}" for n in misshaped]
        lines += [f"  unexpected: {n}" for n in unexpected]
        raise CheckpointError("\n".join(lines))
    for pname, copy in plan:
        dest = params[pname].data[copy.index] if copy.index else params[pname].data
        dest.copy_(read_tensor(reader, copy.name, fp8_block)[0].reshape(dest.shape))
    return len(plan)
