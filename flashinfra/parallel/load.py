"""``load_shard``: one rank's model read straight from the memory-mapped checkpoint, a layer at a time.

No rank holds the whole model: the model is first built on the ``meta`` device and put through the
strict loader (every name, shape and FP8 scale checked against the checkpoint, nothing read); then the
vocabulary-split tables read only this rank's rows (``safe_open(...).get_slice(name)[rows]``), and each
decoder layer in turn is read into host memory, sliced by ``shard.shard_layer`` and moved to the device.
Host memory peaks at about one whole layer (under EP, non-local experts are not even read); the peak
resident set of the process is reported. Block-FP8 tensors are dequantized on the way in, as by the
one-rank loader, so FP8 checkpoints shard the same way. On a world of one it is the one-rank loader
itself (``model.api.load_model``): the same model, no hooks, nothing sliced.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from flashinfra.config import load_config
from flashinfra.model.api import LoadedModel, load_model, resolve_dtype
from flashinfra.model.glm5_next import Glm5NextModel
from flashinfra.model.loader import (FP8_DTYPES, CheckpointReader, _choose_form, dequantize_block_fp8,
                                     load_weights, scale_name)
from flashinfra.model.weights import Copy, weight_layout
from flashinfra.parallel.collectives import ParallelComms
from flashinfra.parallel.layout import ParallelLayout
from flashinfra.parallel.shard import ShardedModel, shard_layer


class _ShapesOnly:
    """The checkpoint's names and shapes with every tensor on ``meta``: the strict loader checks
    everything against it without reading a byte of weights."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self.files = reader, reader.files

    def names(self) -> set[str]:
        return self.reader.names()

    def meta(self, name: str):
        return self.reader.meta(name)

    def get(self, name: str) -> torch.Tensor:
        return torch.empty(self.reader.meta(name)[0], device="meta")


def peak_host_bytes() -> int:
    """Peak resident set of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_shard(path: str | Path, layout: ParallelLayout, comms: ParallelComms, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> ShardedModel | LoadedModel:
    path = Path(path)
    cfg = load_config(path)
    layout.check(cfg.text)
    if layout.world == 1:
        loaded = load_model(path, dtype, device)
        loaded.peak_host_bytes = peak_host_bytes()
        return loaded
    torch_dtype, device = resolve_dtype(dtype), torch.device(device)
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = Glm5NextModel(cfg.text, torch_dtype, cfg.has_lm_head)
    # raises CheckpointError naming every mismatch
    report = load_weights(model, cfg, _ShapesOnly(reader), progress=False)
    qcfg = cfg.raw.get("quantization_config") or cfg.raw.get("text_config", {}).get("quantization_config") or {}
    block = tuple(qcfg.get("weight_block_size", (128, 128)))
    names = reader.names()
    layout_forms = weight_layout(cfg.text, dict(model.named_parameters()), cfg.weight_prefix,
                                 "lm_head.weight" if cfg.has_lm_head else None)
    forms = {p: _choose_form(f, names)[0] for p, f in layout_forms.items()}

    def read(name: str, rows: slice | None = None) -> torch.Tensor:
        if rows is None:
            t = reader.get(name)
        else:
            with safe_open(reader.files[name], framework="pt") as f:
                t = f.get_slice(name)[rows.start : rows.stop]
        if reader.meta(name)[1] in FP8_DTYPES:
            scale = reader.get(scale_name(name))
            if rows is not None:  # the [128, 128] blocks these rows lie in, then the rows themselves
                first = rows.start // block[0] * block[0]
                with safe_open(reader.files[name], framework="pt") as f:
                    t = f.get_slice(name)[first : rows.stop]
                scale = scale[first // block[0] :]
                return dequantize_block_fp8(t, scale[: -(-t.shape[0] // block[0])], block)[rows.start - first :]
            t = dequantize_block_fp8(t, scale, block)
        return t

    def fill(param: torch.Tensor, copies: list[Copy], skip=lambda c: False) -> None:
        for c in copies:
            if not skip(c):
                dest = param.data[c.index] if c.index else param.data
                dest.copy_(read(c.name).reshape(dest.shape))

    vocab = layout.rows(cfg.text.vocab_size)
    for name in ("embed_tokens", "lm_head"):
        if getattr(model, name) is not None:
            (copy,) = forms[name]
            t = read(copy.name, vocab).to(device=device, dtype=torch_dtype)
            setattr(model, name, nn.Parameter(t, requires_grad=False))
    model.norm = nn.Parameter(read(forms["norm"][0].name).to(device=device, dtype=torch_dtype), requires_grad=False)

    experts = layout.experts(cfg.text.n_routed_experts)

    def not_local_expert(c: Copy) -> bool:  # per-expert copies index the expert first
        return bool(c.index) and isinstance(c.index[0], int) and not experts.start <= c.index[0] < experts.stop

    for i, layer in enumerate(model.layers):
        layer.to_empty(device="cpu")
        params = dict(layer.named_parameters(prefix=f"layers.{i}"))
        for pname, param in params.items():
            expert_weight = pname.endswith(("mlp.w13", "mlp.w2"))
            fill(param, forms[pname], not_local_expert if expert_weight else (lambda c: False))
        shard_layer(layer, layout, comms)
        layer.to(device)
    loaded = LoadedModel(path, cfg, model.eval(), torch_dtype, device, report)
    sharded = ShardedModel(loaded, layout, comms)
    sharded.peak_host_bytes = peak_host_bytes()
    return sharded
