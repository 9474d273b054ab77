"""Layer-by-layer accuracy of the kernel path, against the reference path run in a higher precision.

End-to-end logits of a random bf16 model do not tell a correct kernel from a wrong one: a one-ulp change
in a router score moves a token to another expert, a changed expert changes the next layer's routing, and
after a few layers two equally valid roundings give unrelated logits. So every decoder layer is fed the
same input, the one the reference path gave it, and its output is compared three ways: the kernel path
and the reference path, both in the model's dtype, against the reference path in ``hi_dtype``. The kernel
path is accurate when it is no further from the high-precision result than the reference path is.

The prompts are prefilled together, then one decode step follows; each path keeps its own cache, so the
decode step also checks what each path wrote to it. The high-precision run converts one layer at a time
(parameters and cache in ``hi_dtype``), so it needs the memory of one layer more, not of a second model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from flashinfra.kernels.dispatch import kernel_path
from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class LayerError:
    step: str  # "prefill" or "decode"
    layer: int  # decoder layer, or -1 for the final norm and head
    kind: str
    kernel_err: float  # |kernel path - hi| / |hi|
    reference_err: float  # |reference path - hi| / |hi|
    # the row (token; for the head, sampled row) the kernel path is furthest from hi on, and its |kernel - hi| / |hi|:
    # one token far off and the rest close is a routing choice that went the other way, an error over all is arithmetic
    worst_token: int
    worst_token_err: float

    def within(self, factor: float, floor: float) -> bool:
        return self.kernel_err <= factor * self.reference_err + floor


@contextlib.contextmanager
def in_dtype(module: torch.nn.Module, dtype: torch.dtype, recurse: bool = True):
    """Parameters narrower than ``dtype`` converted to it, and back (exact: the conversion widens);
    parameters kept in float32 on purpose (router, mHC) convert only when ``dtype`` is wider still."""
    params = list(module.parameters(recurse=recurse))
    saved = [p.data for p in params]
    for p in params:
        if p.is_floating_point() and torch.finfo(p.dtype).bits < torch.finfo(dtype).bits:
            p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in zip(params, saved):
            p.data = data


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def _worst_row(a: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    """The row of ``a`` [T, ...] relatively furthest from ``ref``'s, and that distance."""
    d, r = a.double().flatten(1), ref.double().flatten(1)
    rel = (d - r).norm(dim=1) / r.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
    i = int(rel.argmax())
    return i, float(rel[i])


class _Step:
    """One forward step of the reference path with every layer's input and output recorded, then each layer
    (and the final norm and head) rerun on the recorded input by the kernel path and in high precision."""

    def __init__(self, lm: LoadedModel, caches: dict[str, ModelCache], hi_dtype: torch.dtype):
        self.lm, self.caches, self.hi = lm, caches, hi_dtype

    def run(self, name: str, ids: torch.Tensor, batch: ForwardBatch) -> tuple[list[LayerError], torch.Tensor]:
        model, dev = self.lm.model, self.lm.device
        inputs, outputs = [], []

        def record(_module, args, out) -> None:
            inputs.append(args[0])
            outputs.append(out)

        hooks = [layer.register_forward_hook(record) for layer in model.layers]
        try:
            with kernel_path(False):
                model(ids, batch, self.caches["reference"])
        finally:
            for h in hooks:
                h.remove()
        paths = {"kernel": self.lm.dtype, "hi": self.hi}
        runs: dict[str, list[torch.Tensor]] = {}
        for path, dtype in paths.items():
            masks: dict = {}
            with kernel_path(path == "kernel"):
                runs[path] = []
                for layer, x in zip(model.layers, inputs):
                    with in_dtype(layer, dtype):
                        runs[path].append(layer(x.to(dtype), batch, self.caches[path], masks))
        errors = []
        for i, layer in enumerate(model.layers):
            kind = ("kda" if layer.is_kda else "mla") + "+" + type(layer.mlp).__name__.lower()
            hi = runs["hi"][i]
            errors.append(LayerError(name, i, kind, _rel(runs["kernel"][i], hi), _rel(outputs[i], hi),
                                     *_worst_row(runs["kernel"][i], hi)))
        last = torch.tensor(batch.last_token_indices, device=dev)
        logits = {}
        for path, dtype in (("reference", self.lm.dtype), *paths.items()):
            with kernel_path(path == "kernel"), in_dtype(model, dtype, recurse=False):
                logits[path] = model.compute_logits(model.final_norm(outputs[-1].to(dtype))[last])
        errors.append(LayerError(name, -1, "norm+head", _rel(logits["kernel"], logits["hi"]),
                                 _rel(logits["reference"], logits["hi"]), *_worst_row(logits["kernel"], logits["hi"])))
        return errors, logits["hi"].argmax(-1)


@torch.inference_mode()
def compare_layers(lm: LoadedModel, prompts: list[list[int]], hi_dtype: torch.dtype = torch.float32,
                   block_size: int = 16) -> list[LayerError]:
    """The prompts prefilled together, then one decode step: a ``LayerError`` per layer and step."""
    cfg, dev = lm.config.text, lm.device
    need = [-(-(len(p) + 1) // block_size) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(prompts))]
    slots = list(range(len(prompts)))
    blocks = sum(need)
    caches = {"reference": lm.allocate_cache(blocks, block_size, len(prompts)),
              "kernel": lm.allocate_cache(blocks, block_size, len(prompts)),
              "hi": ModelCache.allocate(cfg, blocks, block_size, len(prompts), hi_dtype, dev,
                                        state_dtype=torch.promote_types(hi_dtype, torch.float32))}
    step = _Step(lm, caches, hi_dtype)
    prefill = ForwardBatch.build([len(p) for p in prompts], [0] * len(prompts), slots, tables, block_size, dev)
    errors, nxt = step.run("prefill", torch.tensor([t for p in prompts for t in p], device=dev), prefill)
    decode = ForwardBatch.build([1] * len(prompts), [len(p) for p in prompts], slots, tables, block_size, dev)
    return errors + step.run("decode", nxt, decode)[0]
