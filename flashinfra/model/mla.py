"""MLA layer without RoPE, attending sparsely over the DSA indexer's selection.

The cache holds one ``kv_lora_rank`` latent per token (after ``kv_a_layernorm``). Prefill expands the
latent into per-head keys and values with ``kv_b_proj``; decode uses the absorbed form: ``kv_b``'s key
half is folded into the query and its value half into the output, so attention runs on the latent
directly and the cache stays ``kv_lora_rank`` values per token.

Where the Triton kernels run (``dispatch.use_triton``), one path serves every batch with tensors only: the
indexer's selection as position lists (``kernels.dsa_indexer``) and the absorbed form for prefill and decode
alike over the paged latent (``kernels.sparse_mla``), so that a decode step can be graph-captured.

``forward`` is three steps, each callable alone (context parallelism brings other ranks' latent rows between
the selection and the attention): ``queries`` (the projections, the new tokens' latent into the cache),
``index`` (the indexer's selection) and ``attend``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashinfra.config import TextConfig
from flashinfra.kernels.batch_invariant import matmul_nt
from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.dsa_indexer import dsa_select
from flashinfra.kernels.sparse_mla import sparse_mla_launch
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.indexer import Indexer
from flashinfra.quant.cache import norm_latent, read_index_entries, read_latent, write_index_rows
from flashinfra.quant.linear import linear, normed, rms_norm_for


def gather_seq(paged: torch.Tensor, blocks: tuple[int, ...], n: int) -> torch.Tensor:
    """The first ``n`` entries of one sequence from a paged cache ``[num_blocks, block_size, W]``."""
    return paged[list(blocks)].flatten(0, 1)[:n]


class MLAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer, self.H, self.R = layer, cfg.num_attention_heads, cfg.kv_lora_rank
        self.Dq, self.Dv, self.eps = cfg.qk_head_dim, cfg.v_head_dim, cfg.rms_norm_eps
        self.scaling = self.Dq**-0.5
        self.q_lora = cfg.q_lora_rank

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        D = cfg.hidden_size
        self.qkv_a_proj = param(self.q_lora + self.R, D)  # q_a_proj | kv_a_proj_with_mqa
        self.qkv_a_bias = param(self.q_lora + self.R) if cfg.attention_bias else None
        self.q_a_norm = param(self.q_lora)
        self.kv_a_norm = param(self.R)
        self.q_b_proj = param(self.H * self.Dq, self.q_lora)
        self.kv_b_proj = param(self.H * (self.Dq + self.Dv), self.R)
        self.o_proj = param(D, self.H * self.Dv)
        self.o_bias = param(D) if cfg.attention_bias else None
        self.indexer = Indexer(cfg, dtype) if cfg.indexer_types[layer] == "full" else None
        self.source = cfg.indexer_source(layer)  # the layer whose selection this one uses

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache, masks: dict
    ) -> torch.Tensor:
        """``masks`` maps a full-indexer layer to its selection; this layer adds its own. Reference path: a
        list of per-sequence ``[L, N]`` masks; kernel path: one ``[T, S]`` tensor of positions (-1 none)."""
        q, q_resid, _ = self.queries(x, batch, cache)
        x = normed(x)  # ``Int8Rows`` under W8A8 (DecoderLayer): the rows in the model dtype for the indexer
        self.index(x, q_resid, batch, cache, masks)
        return self.attend(x, q, batch, cache, masks)

    def queries(self, x, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The new tokens' latent written to the cache -> (q [T, H, Dq], the indexer's query input [T, q_lora],
        the latent [T, R]); one projection forms the latent together with q. ``x``: the normed rows, or their
        ``Int8Rows`` under W8A8."""
        T = x.shape[0]
        q_a, kv_a = linear(x, self.qkv_a_proj, self.qkv_a_bias).split([self.q_lora, self.R], dim=-1)
        q_rows = rms_norm_for(q_a, self.q_a_norm, self.eps, self.q_b_proj, True)
        q_resid = normed(q_rows)
        q = linear(q_rows, self.q_b_proj).view(T, self.H, self.Dq)
        latent = norm_latent(cache, self.layer, batch.slot_mapping, kv_a, self.kv_a_norm, self.eps)
        return q, q_resid, latent

    def index(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
              masks: dict) -> None:
        """This layer's own selection into ``masks`` (the new tokens' indexer entries written to the cache on
        the way); a layer with a shared indexer adds none."""
        if self.indexer is None:
            return
        if not use_triton(x, cache.mla_latent[self.layer]):
            masks[self.layer] = self._select(x, q_resid, batch, cache)
            return
        ix = self.indexer
        qi, w = self._index_new_tokens(x, q_resid, batch, cache)
        masks[self.layer] = dsa_select(cache.indexer_pool_keys[self.layer], qi, w, batch.block_tables_t,
                                       batch.token_seq, batch.positions, ix.kpool, ix.topk, ix.keep_tail)

    def attend(self, x: torch.Tensor, q: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
               masks: dict) -> torch.Tensor:
        """Sparse attention of ``q`` over the cached latent that ``masks[self.source]`` selects, and the output
        projection. Kernel path: tensors only (no per-sequence loop, no host sync), the absorbed form for prefill
        and decode alike over the paged latent."""
        T = x.shape[0]
        selection = masks[self.source]
        if use_triton(x, cache.mla_latent[self.layer]):
            w = self.kv_b_proj.view(self.H, self.Dq + self.Dv, self.R)
            q_lat = matmul_nt(q.transpose(0, 1), w[:, : self.Dq].transpose(1, 2)).transpose(0, 1)  # [T, H, R]
            o_lat = sparse_mla_launch(q_lat, cache.mla_latent[self.layer], selection, batch.token_seq,
                                      batch.block_tables_t, self.scaling, cache.mla_latent_scale.get(self.layer))
            out = matmul_nt(o_lat.transpose(0, 1), w[:, self.Dq :]).transpose(0, 1)  # [T, H, Dv]
            return linear(out.reshape(T, -1), self.o_proj, self.o_bias)
        attend = self._decode if batch.is_decode else self._prefill
        out = torch.empty(T, self.H, self.Dv, dtype=x.dtype, device=x.device)
        for b, (bos, eos) in enumerate(zip(batch.cu_seqlens_list, batch.cu_seqlens_list[1:])):
            c = read_latent(cache, self.layer, batch.block_tables[b], batch.seq_lens[b], x.dtype)
            out[bos:eos] = attend(q[bos:eos], c, selection[b])
        return linear(out.flatten(1), self.o_proj, self.o_bias)

    def _index_new_tokens(self, x, q_resid, batch: ForwardBatch, cache: ModelCache):
        """Write the new tokens' indexer entries (and the pools they complete) to the cache -> (queries, head
        weights)."""
        kg, q, w = self.indexer.project(x, q_resid)
        write_index_rows(cache, self.layer, batch.slot_mapping, kg, self.indexer)
        return q, w

    def _select(self, x, q_resid, batch: ForwardBatch, cache: ModelCache) -> list[torch.Tensor]:
        q, w = self._index_new_tokens(x, q_resid, batch, cache)
        out = []
        for b, (bos, eos) in enumerate(zip(batch.cu_seqlens_list, batch.cu_seqlens_list[1:])):
            seq_entries = read_index_entries(cache, self.layer, batch.block_tables[b], batch.seq_lens[b], x.dtype)
            out.append(self.indexer.select(seq_entries, q[bos:eos], w[bos:eos]))
        return out

    def _prefill(self, q: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [L, H, Dq], latent c [N, R], mask [L, N] -> [L, H, Dv]."""
        kv = F.linear(c, self.kv_b_proj).view(-1, self.H, self.Dq + self.Dv)
        k, v = kv.split([self.Dq, self.Dv], dim=-1)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scaling
        ).transpose(0, 1)

    def _decode(self, q: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Absorbed form: scores and values on the latent, kv_b folded into q and the output."""
        w = self.kv_b_proj.view(self.H, self.Dq + self.Dv, self.R)
        w_uk, w_uv = w[:, : self.Dq], w[:, self.Dq :]  # [H, Dq, R], [H, Dv, R]
        q_lat = torch.einsum("lhd,hdr->lhr", q, w_uk)  # [L, H, R]
        scores = torch.einsum("lhr,nr->lhn", q_lat.float(), c.float()) * self.scaling
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        o_lat = torch.einsum("lhn,nr->lhr", torch.softmax(scores, dim=-1), c.float()).to(q.dtype)
        return torch.einsum("lhr,hvr->lhv", o_lat, w_uv)
