"""Batch invariance, layer by layer: each decoder layer of a packed batch against each sequence run alone from the
same inputs.

A packed step runs the model with every layer's input and output recorded; then each sequence runs alone, each
layer fed that sequence's rows of the packed run's input, with its own cache (same block tables and slots, a second
cache object), and its output is compared with its rows of the packed output. Fed the same input, a layer that
leaks nothing across sequences differs from the packed run only by the rounding of the kernels' batch-shaped
choices (tile shapes, splits, algorithms): at most a few units of the dtype's epsilon of the values it rounds.
That is what ``SeqDiff.ulps`` measures: ``max |packed - alone| / (eps * max(|out| + |out - in|))`` over a
sequence's rows, the scale being the layer's output (the residual streams it rounds) plus its update (what the
layer computed). A leak shows at the scale of the update, hundreds of units or more; with
``dispatch.deterministic`` on, every difference is exactly 0.

Steps are given as new tokens per sequence (a sequence's context is the tokens of its earlier steps), so one list
covers prefill, chunked prefill (pieces on a cached state, which is also what a prefix hit resumes from) and
decode; ``graph_decode_diff`` compares a CUDA-graph decode step of the whole batch with each sequence's eager decode
from the same cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch

ULP_BOUND = 8.0  # a layer's batch-shaped rounding, in units of eps of its scale: a few roundings of that scale


@dataclass(frozen=True)
class SeqDiff:
    step: str
    layer: int  # decoder layer; -1: final norm and head (logits); -2: a graph-replayed step's final hidden states
    seq: int
    ulps: float  # the largest row difference in units of eps of the layer's scale (see the module docstring)
    rows_over: int  # rows beyond ``bound``
    rows: int
    exact: bool  # every element the same bits
    bound: float = ULP_BOUND


def clone_cache(cache: ModelCache) -> ModelCache:
    """A copy of every tensor of ``cache`` (one more cache of the same size in memory)."""
    return dataclasses.replace(cache, **{f.name: {k: v.clone() for k, v in getattr(cache, f.name).items()}
                                         for f in dataclasses.fields(cache) if f.name != "replay"
                                         and isinstance(getattr(cache, f.name), dict)})


def _diff(step: str, layer: int, seq: int, alone: torch.Tensor, packed: torch.Tensor, inp: torch.Tensor | None,
          eps: float, bound: float = ULP_BOUND) -> SeqDiff:
    a, p = alone.double().flatten(1), packed.double().flatten(1)
    scale = p.abs() + ((p - inp.double().flatten(1)).abs() if inp is not None else 0)
    unit = eps * scale.max().clamp_min(torch.finfo(torch.float32).tiny)
    rows = (a - p).abs().amax(1) / unit  # [rows]
    return SeqDiff(step, layer, seq, float(rows.max()), int((rows > bound).sum()), rows.numel(),
                   bool(torch.equal(alone, packed)), bound)


class _Layout:
    """Block tables and state slots for the sequences' whole lengths, shared by the packed and alone caches."""

    def __init__(self, lengths: list[int], block_size: int, extra: int = 0):
        need = [-(-n // block_size) for n in lengths]
        self.tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(lengths))]
        self.slots = list(range(len(lengths)))
        self.blocks, self.block_size = sum(need) + extra, block_size


def _record(model, ids: torch.Tensor, batch: ForwardBatch, cache: ModelCache):
    inputs, outputs = [], []

    def hook(_module, args, out) -> None:
        inputs.append(args[0])
        outputs.append(out)

    hooks = [layer.register_forward_hook(hook) for layer in model.layers]
    try:
        model(ids, batch, cache)
    finally:
        for h in hooks:
            h.remove()
    return inputs, outputs


@torch.inference_mode()
def layer_diffs(lm: LoadedModel, steps: list[tuple[str, list[list[int]]]], block_size: int = 16) -> list[SeqDiff]:
    """``steps``: (name, new tokens of each sequence) in order -> a ``SeqDiff`` per step, layer and sequence."""
    model, dev = lm.model, lm.device
    eps = torch.finfo(lm.dtype).eps
    n = len(steps[0][1])
    lengths = [sum(len(s[1][b]) for s in steps) for b in range(n)]
    lay = _Layout(lengths, block_size)
    packed_cache, alone_cache = (lm.allocate_cache(lay.blocks, block_size, n) for _ in range(2))
    context = [0] * n
    out: list[SeqDiff] = []
    for name, tokens in steps:
        batch = ForwardBatch.build([len(t) for t in tokens], context, lay.slots, lay.tables, block_size, dev)
        ids = torch.tensor([t for seq in tokens for t in seq], device=dev)
        inputs, outputs = _record(model, ids, batch, packed_cache)
        cu = batch.cu_seqlens_list
        for b in range(n):
            rows = slice(cu[b], cu[b + 1])
            alone = ForwardBatch.build([len(tokens[b])], [context[b]], [lay.slots[b]], [lay.tables[b]], block_size,
                                       dev)
            masks: dict = {}
            for i, layer in enumerate(model.layers):
                y = layer(inputs[i][rows], alone, alone_cache, masks)
                out.append(_diff(name, i, b, y, outputs[i][rows], inputs[i][rows], eps))
            last = outputs[-1][cu[b + 1] - 1: cu[b + 1]]
            logits = model.compute_logits(model.final_norm(last))
            ref = model.compute_logits(model.final_norm(outputs[-1]))[cu[b + 1] - 1: cu[b + 1]]
            out.append(_diff(name, -1, b, logits, ref, None, eps))
        context = [c + len(t) for c, t in zip(context, tokens)]
    return out


@torch.inference_mode()
def graph_decode_diff(lm: LoadedModel, prompts: list[list[int]], block_size: int = 16) -> list[SeqDiff]:
    """The prompts prefilled together, then one decode step of the whole batch replayed from a CUDA graph against
    each sequence's eager decode step from a copy of the same cache: a ``SeqDiff`` per sequence (final hidden).
    The whole model's rounding adds up over its layers: the bound is ``ULP_BOUND`` per layer."""
    from flashinfra.engine.cuda_graphs import DecodeGraphs

    dev, n = lm.device, len(prompts)
    lay = _Layout([len(p) + 1 for p in prompts], block_size, extra=1)
    cache = lm.allocate_cache(lay.blocks, block_size, n + 1)
    prefill = ForwardBatch.build([len(p) for p in prompts], [0] * n, lay.slots, lay.tables, block_size, dev)
    hidden = lm.forward(torch.tensor([t for p in prompts for t in p], device=dev), prefill, cache)
    nxt = lm.compute_logits(hidden[torch.tensor(prefill.last_token_indices, device=dev)]).argmax(-1)
    eager_cache = clone_cache(cache)
    decode = ForwardBatch.build([1] * n, [len(p) for p in prompts], lay.slots, lay.tables, block_size, dev)
    # the capture's warm-up runs write only the scratch block and slot; the replay writes the sequences' own
    replayed = DecodeGraphs(lm, cache, lay.blocks - 1, n).run(nxt, decode)
    eps = torch.finfo(lm.dtype).eps
    out = []
    for b in range(n):
        alone = ForwardBatch.build([1], [len(prompts[b])], [lay.slots[b]], [lay.tables[b]], block_size, dev)
        h = lm.forward(nxt[b: b + 1], alone, eager_cache)
        out.append(_diff("graph decode", -2, b, h, replayed[b: b + 1], None, eps,
                         ULP_BOUND * (len(lm.model.layers) + 1)))
    return out


def summary(diffs: list[SeqDiff]) -> list[dict]:
    """Per step and layer: the largest ``ulps`` over the sequences, rows beyond the bound, and whether all were
    exact."""
    keys = list(dict.fromkeys((d.step, d.layer) for d in diffs))
    rows = []
    for step, layer in keys:
        ds = [d for d in diffs if (d.step, d.layer) == (step, layer)]
        rows.append(dict(step=step, layer=layer, bound=ds[0].bound, max_ulps=max(d.ulps for d in ds),
                         rows_over=sum(d.rows_over for d in ds), rows=sum(d.rows for d in ds),
                         exact=all(d.exact for d in ds)))
    return rows
