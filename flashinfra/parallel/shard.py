"""Shard a loaded ``Glm5NextModel`` for one rank and add the reductions its forward needs.

Per layer kind (``layout.py`` says who owns what; ``Comm`` does the collectives):

- KDA: heads split over TP ranks. The fused in-projection's q|k|v and beta rows, the conv channels,
  ``f_b``/``g_b``/``dt_bias``/``A_log`` are taken per head; the forget/output-gate low-rank inputs
  (``f_a``, ``g_a``, K wide) are shared by all heads and stay whole. Each rank's state slots hold only
  its heads (``[slots, H / tp, K, V]``): the recurrence is independent per head. ``o_proj`` is split by
  input columns, so each rank's output is a partial sum: one all-reduce.
- MLA: heads split (``q_b_proj`` and ``kv_b_proj`` rows per head, ``o_proj`` columns): one all-reduce.
  The 512-d latent (``kv_a_proj``) is shared by every head, so every rank computes and caches all of
  it; splitting it would need a gather before every attention.
- DSA indexer: replicated. Its heads' ReLU scores are summed before the top-k, so splitting the heads
  would add an all-reduce of the ``[T, pools]`` float32 scores per full-indexer layer, and save little:
  every head scores the same pooled keys, so a rank reads all of them whatever its share of heads. Per
  pooled key read (``index_head_dim`` 128 in bf16 = 256 B) the 32 heads do 2 * 32 * 128 = 8192 FLOPs,
  32 FLOP/B, far under the about 200 FLOP/B (989 TFLOP/s over 4.8 TB/s) where an H200 stops being
  bound by memory: a decode step's scoring costs the key reads, which a head split does not divide.
  A prefill chunk of 2048 tokens over a 131072-token context has 32768 pools: 2048 * 32768 * 4 B =
  256 MiB of scores to all-reduce per layer, against its weights (``x_proj`` (128 + 128 + 32) x 4096 and
  ``wq_b`` 4096 x 1536, 7.5 M parameters, 15 MB in bf16) kept whole on every rank. Replicated, every
  rank computes the same selection with no collective.
- Dense MLP: gate|up rows and down columns split over the TP group (column-then-row parallel).
- MoE, over the MoE group of ``layout.py``: the router is replicated (every rank routes every token
  alike). ``ep > 1``: each rank holds ``E / ep`` whole experts and runs only the (token, expert) pairs it
  owns (weights of other pairs set to zero), and a ``1 / ep`` slice of the shared expert. ``ep == 1``:
  each rank holds a ``1 / tp`` slice of every expert's intermediate dimension and of the shared expert.
  Hidden states are replicated after every all-reduce, so dispatch is free (each rank already has every
  token) and combine is a sum over the group: the routed partials and the shared expert's partial are
  added locally and reduced by one all-reduce.

  Dispatch and combine, the rule: an all-reduce is a reduce-scatter plus an all-gather, so this is the
  all-gather + reduce-scatter scheme with the all-gather done by the previous all-reduce and the
  reduce-scatter and next all-gather fused into this one. An all-to-all moves only the top-k pairs,
  ``T * k / world`` rows each way per rank against ``T`` for the gather and the scatter: less only when
  ``k < world`` (never for this model's top-8 on up to 8 ranks), and it needs hidden states split by
  token (data-parallel attention or sequence parallel), which this layout does not have.
  ``bench/parallel_moe_dispatch.py`` measures both schemes over 2, 4 and 8 ranks for the layout that
  would choose between them.
- Embedding: vocab rows split; each rank looks up the ids it owns (zero elsewhere): one all-reduce.
  lm_head: vocab rows split; logits all-gathered along the vocabulary.
- mHC hyper-connections and the norms: replicated (they act on the replicated hidden states).

Collectives per decoder layer: 2 all-reduces of ``[T, D]`` (attention over the TP group, then MLP over
the TP group or MoE over the MoE group); per step 1 more for the embedding and 1 all-gather of the
logits. A group of one rank has no collective and no hook; on a world of one nothing here runs at all
(``shard_loaded`` and ``load.load_shard`` give the plain model), so world size 1 costs nothing.

``shard_parameters`` / ``shard_layer`` are the one place that knows each slice: ``shard_loaded`` applies
them to a model loaded whole (tests, one host with room), ``load.load_shard`` to one layer at a time
as it reads the checkpoint, so no rank holds the whole model. 8-bit weights (``QuantizedWeight``) are
sliced with the scales that cover them (``quant.slicing``): a rank's codes and scales are its slice of
the one-rank quantization, and an FP8 split that would cut 128 x 128 blocks raises ``LayoutError`` naming
the tensor. The caches follow the same split: the MLA latent (with its per-token scale where 8-bit) is
whole on every rank, the KDA state slots hold the rank's heads in their float32 or bf16 dtype.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashinfra.config import TextConfig
from flashinfra.kernels.moe_route import route
from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.kda import KDAttention
from flashinfra.model.mla import MLAttention
from flashinfra.model.moe import DenseMLP, MoE
from flashinfra.parallel.collectives import Comm, ParallelComms
from flashinfra.parallel.layout import LayoutError, ParallelLayout
from flashinfra.quant.linear import moe_experts
from flashinfra.quant.model import quantized_weights, shared_is_stacked
from flashinfra.quant.slicing import BlockSplitError, Weight, cat_rows, owned, take_cols, take_experts, take_rows
from flashinfra.quant.weights import QuantizedWeight


def _set(module: nn.Module, name: str, value: Weight | None) -> None:
    """Replace a weight by its rank's slice, in storage of its own; a ``QuantizedWeight`` stays a plain
    attribute (it holds 8-bit storage and scales, as ``quant.model`` put it)."""
    if value is None:
        return
    if isinstance(value, QuantizedWeight):
        module._parameters.pop(name, None)
        object.__setattr__(module, name, owned(value))
    else:
        setattr(module, name, nn.Parameter(owned(value), requires_grad=False))


def _head_rows(w: Weight, heads: slice, width: int, name: str) -> Weight:
    """Rows of heads ``heads`` from ``w`` whose rows are ``H`` blocks of ``width``."""
    return take_rows(w, slice(heads.start * width, heads.stop * width), name)


def _rows_split(w: Weight, sizes: list[int], name: str) -> list[Weight]:
    """``w``'s rows as consecutive pieces of ``sizes`` rows."""
    out, r = [], 0
    for n in sizes:
        out.append(take_rows(w, slice(r, r + n), name))
        r += n
    return out


def _shard_kda(m: KDAttention, layout: ParallelLayout, name: str) -> None:
    H, K = m.H, m.K
    heads = layout.rows(H)
    HK = H * K
    w = f"{name}.in_proj"
    q, k, v, gates, b = _rows_split(m.in_proj, [HK, HK, HK, 2 * K, H], w)  # gates: f_a | g_a, kept whole
    _set(m, "in_proj", cat_rows([_head_rows(q, heads, K, w + " (q rows)"), _head_rows(k, heads, K, w + " (k rows)"),
                                 _head_rows(v, heads, K, w + " (v rows)"), gates,
                                 _head_rows(b, heads, 1, w + " (beta rows)")], w))
    _set(m, "conv_weight", torch.cat([c[heads.start * K : heads.stop * K] for c in m.conv_weight.split(HK)]))
    for pname in ("fg_b_proj", "dt_bias"):
        _set(m, pname, _head_rows(getattr(m, pname), heads, K, f"{name}.{pname}"))
    _set(m, "A_log", m.A_log[heads])
    _set(m, "o_proj", take_cols(m.o_proj, slice(heads.start * K, heads.stop * K), f"{name}.o_proj"))
    m.H = H // layout.tp
    m.splits = [3 * m.H * K, K, K, m.H]


def _shard_mla(m: MLAttention, layout: ParallelLayout, name: str) -> None:
    heads = layout.rows(m.H)
    _set(m, "q_b_proj", _head_rows(m.q_b_proj, heads, m.Dq, f"{name}.q_b_proj"))
    _set(m, "kv_b_proj", _head_rows(m.kv_b_proj, heads, m.Dq + m.Dv, f"{name}.kv_b_proj"))
    _set(m, "o_proj", take_cols(m.o_proj, slice(heads.start * m.Dv, heads.stop * m.Dv), f"{name}.o_proj"))
    if m.o_bias is not None and layout.tp_rank != 0:  # the bias is added once, by the group's first rank
        _set(m, "o_bias", torch.zeros_like(m.o_bias))
    m.H = m.H // layout.tp


def _split_swiglu(gate_up: Weight, down: Weight, cols: slice, name: str) -> tuple[Weight, Weight]:
    """gate|up ``[..., 2I, D]`` and down ``[..., D, I]`` -> the intermediate slice ``cols`` of both."""
    I = down.shape[-1]
    gate, up = _rows_split(gate_up, [I, I], f"{name} gate|up")
    gu = cat_rows([take_rows(gate, cols, f"{name} gate rows"), take_rows(up, cols, f"{name} up rows")],
                  f"{name} gate|up")
    return gu, take_cols(down, cols, f"{name} down columns")


def _shard_dense(m: DenseMLP, cols: slice, name: str) -> None:
    gu, d = _split_swiglu(m.gate_up_proj, m.down_proj, cols, name)
    _set(m, "gate_up_proj", gu)
    _set(m, "down_proj", d)


class ShardedMoE(nn.Module):
    """One rank's part of a ``MoE`` in its MoE group; its output is a partial sum (the caller all-reduces
    it over the group). The MoE may hold every expert or, as ``load.py`` builds it, only this rank's; and
    float or quantized weights, its shared expert stacked after the routed ones (``quant.model``) or not."""

    def __init__(self, moe: MoE, layout: ParallelLayout, name: str = "mlp"):
        super().__init__()
        self.cfg = moe.cfg
        E = moe.router_weight.shape[0]
        self.router_weight, self.router_bias = moe.router_weight, moe.router_bias
        experts = layout.experts(E)
        self.first_expert, self.num_local = experts.start, experts.stop - experts.start
        w13, w2 = moe.w13, moe.w2
        s13, s2 = moe.shared.gate_up_proj, moe.shared.down_proj
        if shared_is_stacked(w13, s13):  # the routed experts alone; the shared expert is sliced on its own
            w13, w2 = take_experts(w13, slice(0, w13.shape[0] - 1)), take_experts(w2, slice(0, w2.shape[0] - 1))
        if w13.shape[0] == E and self.num_local != E:
            w13, w2 = take_experts(w13, experts), take_experts(w2, experts)
        if layout.ep == 1:
            w13, w2 = _split_swiglu(w13, w2, layout.moe_rows(w2.shape[-1]), f"{name}.experts")
        s13, s2 = _split_swiglu(s13, s2, layout.moe_rows(s2.shape[-1]), f"{name}.shared_experts")
        _set(self, "w13", w13)
        _set(self, "w2", w2)
        # of the routed experts' shape (TP), the shared expert runs in their launches (``quant.linear``)
        self.shared = moe.shared
        _set(self.shared, "gate_up_proj", s13)
        _set(self.shared, "down_proj", s2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        w, ids = route(x, self.router_weight, self.router_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
                       c.norm_topk_prob, c.routed_scaling_factor)
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.num_local)
        # pairs owned by another rank: weight 0 on a valid local expert, so shapes stay static (graphs)
        w = torch.where(mine, w, torch.zeros_like(w))
        local = torch.where(mine, local, torch.zeros_like(local))
        return moe_experts(x, self.w13, self.w2, w, local, c.swiglu_limit, self.shared.gate_up_proj,
                           self.shared.down_proj)


def _reduce_output(comm: Comm):
    def hook(module, args, out):
        return comm.all_reduce(out)
    return hook


def shard_parameters(model: nn.Module, layout: ParallelLayout, comms: ParallelComms) -> None:
    """Slice every sharded parameter of ``model`` (a full ``Glm5NextModel``) in place for ``layout.rank``
    and register the all-reduces on the partial outputs; nothing at all on a world of one."""
    if layout.tp > 1:
        vocab = layout.rows(model.cfg.vocab_size)
        _set(model, "embed_tokens", model.embed_tokens[vocab])
        if model.lm_head is not None:  # float, or W8A8 with a scale per vocabulary row
            _set(model, "lm_head", take_rows(model.lm_head, vocab, "lm_head"))
    for layer in model.layers:
        shard_layer(layer, layout, comms)


def shard_layer(layer: nn.Module, layout: ParallelLayout, comms: ParallelComms) -> None:
    """Slice one ``DecoderLayer`` in place and register its all-reduces (one per sub-block split over more
    than one rank)."""
    name = f"layers.{layer.attn.layer}"
    try:
        if layout.tp > 1:
            (_shard_kda if layer.is_kda else _shard_mla)(layer.attn, layout, f"{name}.attn")
            layer.attn.register_forward_hook(_reduce_output(comms.tp))
        if isinstance(layer.mlp, MoE):
            if layout.moe_size > 1:
                layer.mlp = ShardedMoE(layer.mlp, layout, f"{name}.mlp")
                layer.mlp.register_forward_hook(_reduce_output(comms.moe))
        elif layout.tp > 1:
            _shard_dense(layer.mlp, layout.rows(layer.mlp.down_proj.shape[-1]), f"{name}.mlp")
            layer.mlp.register_forward_hook(_reduce_output(comms.tp))
    except BlockSplitError as e:
        raise LayoutError(f"cannot shard FP8 weights over tensor_parallel_size={layout.tp}, "
                          f"expert_parallel_size={layout.ep}: {e}") from None


class ShardedModel:
    """One rank's model (world > 1): the ``LoadedModel`` calls (``forward``, ``compute_logits``,
    ``allocate_cache``, ``logits``) over weights already sharded (``shard_parameters``, or
    ``load.load_shard``); every rank must make the same calls in the same order."""

    def __init__(self, loaded: LoadedModel, layout: ParallelLayout, comms: ParallelComms):
        self.loaded, self.layout, self.comms = loaded, layout, comms
        self.config, self.dtype, self.device = loaded.config, loaded.dtype, loaded.device
        self.path, self.report = loaded.path, loaded.report
        self.quantization, self.cache_spec = loaded.quantization, loaded.cache_spec
        self.vision = None  # the vision tower's embeddings feed a vocab-split table: not sharded yet
        self.model = loaded.model
        self.vocab = layout.rows(loaded.config.text.vocab_size)
        # the cache of one rank: its KDA heads only; MLA latent and indexer keys whole (see module doc)
        self.cache_text: TextConfig = dataclasses.replace(
            loaded.config.text, linear_num_heads=loaded.config.text.linear_num_heads // layout.tp)

    def latent_dtypes(self) -> dict[int, torch.dtype]:
        return self.cache_spec.latent_dtypes(self.config.text.mla_layers, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, num_slots: int) -> ModelCache:
        return ModelCache.allocate(self.cache_text, num_blocks, block_size, num_slots, self.dtype, self.device,
                                   self.cache_spec.state_dtype, self.latent_dtypes())

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return F.embedding(input_ids, self.model.embed_tokens)
        local = input_ids - self.vocab.start
        mine = (local >= 0) & (local < self.vocab.stop - self.vocab.start)
        x = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.model.embed_tokens)
        return self.comms.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
                inputs_embeds: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = self.model(input_ids, batch, cache, inputs_embeds=x)
        return hidden if rows is None else hidden[rows]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comms.tp.all_gather_last(self.model.compute_logits(hidden))

    def logits(self, prompts: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
        return LoadedModel.logits(self, prompts, block_size)  # same packing; our forward and cache


def named_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of every weight of ``model`` by name: its parameters and its 8-bit weights (codes and scales; a
    shared expert stacked with the routed experts counted once, with them)."""
    out = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    stacked = set()
    for m in model.modules():
        if hasattr(m, "w13") and hasattr(m, "shared") and shared_is_stacked(m.w13, m.shared.gate_up_proj):
            stacked |= {id(m.shared.gate_up_proj), id(m.shared.down_proj)}
    out.update({n: w.nbytes() for n, w in quantized_weights(model).items() if id(w) not in stacked})
    return out


def weight_bytes(model: nn.Module) -> int:
    return sum(named_weight_bytes(model).values())


def shard_loaded(loaded: LoadedModel, layout: ParallelLayout, comms: ParallelComms) -> ShardedModel | LoadedModel:
    """``loaded`` itself, untouched, on a world of one; else its shard for ``layout.rank``."""
    layout.check(loaded.config.text)
    if layout.world == 1:
        return loaded
    shard_parameters(loaded.model, layout, comms)
    return ShardedModel(loaded, layout, comms)
