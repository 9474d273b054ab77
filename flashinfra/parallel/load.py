"""``load_shard``: one rank's model read straight from the memory-mapped checkpoint, a layer at a time;
``random_shard``: the same from random tensors made on the device (a whole-size model without a checkpoint).

No rank holds the whole model: the model is first built on the ``meta`` device and put through the
strict loader (every name, shape and 8-bit scale checked against the checkpoint, nothing read); then the
vocabulary-split tables read only this rank's rows (``safe_open(...).get_slice(name)[rows]``), and each
decoder layer in turn is read into host memory, sliced by ``shard.shard_layer`` and moved to the device.
Under EP a layer holds only this rank's experts from the start, so non-local experts are neither
allocated nor read. Host memory peaks at about one layer; the peak resident set of the process is reported.

8-bit weights: with a weight mode (``--quantization`` w8a8 / fp8, or a W8A8 checkpoint), the layer is
quantized whole on the device, keeping the checkpoint's 8-bit tensors as stored, exactly as the one-rank
loader does (``quant.model.quantize_model``), and then sliced (``quant.slicing``): every rank holds its
slice of the one-rank codes and scales. A per-channel scale is the whole row's even where a rank keeps part
of the row; an FP8 slice keeps whole 128 x 128 blocks, and a split that would cut blocks is refused naming
the tensor. Without a weight mode, 8-bit tensors are dequantized on the way in, as by the one-rank loader.
On a world of one it is the one-rank loader itself (``model.api.load_model``): the same model, no hooks,
nothing sliced.
"""

from __future__ import annotations

import resource
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from flashinfra.config import load_config
from flashinfra.model.api import (LoadedModel, load_model, model_config_from, random_model, resolve_dtype,
                                  resolve_load)
from flashinfra.model.factory import RandomSource
from flashinfra.model.glm5_next import Glm5NextModel
from flashinfra.model.loader import (FP8_DTYPES, CheckpointReader, _choose_form, dequantize_block_fp8,
                                     load_weights, read_tensor, scale_name, w8a8_scale_name, weight_block)
from flashinfra.model.moe import MoE
from flashinfra.model.weights import Copy, weight_layout
from flashinfra.parallel.collectives import ParallelComms
from flashinfra.parallel.layout import ParallelLayout
from flashinfra.parallel.shard import ShardedModel, shard_layer
from flashinfra.quant.cache import CacheSpec
from flashinfra.quant.model import RawQuantized, quantize_model, quantize_own_parameters


class _ShapesOnly:
    """The checkpoint's names and shapes with every tensor on ``meta``: the strict loader checks
    everything against it without reading a byte of weights."""

    def __init__(self, reader):
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
               device: str | torch.device = "cpu", quantization: str = "auto",
               cache_spec: CacheSpec | None = None) -> ShardedModel | LoadedModel:
    """This rank's model from the checkpoint at ``path``; ``quantization`` and ``cache_spec`` as for
    ``model.api.load_model``."""
    path = Path(path)
    cfg = load_config(path)
    layout.check(cfg.text)
    if layout.world == 1:
        loaded = load_model(path, dtype, device, quantization=quantization, cache_spec=cache_spec)
        loaded.peak_host_bytes = peak_host_bytes()
        return loaded
    return _build_shard(path, cfg, CheckpointReader(path), torch.device("cpu"), layout, comms, dtype, device,
                        quantization, cache_spec)


def random_shard(config, layout: ParallelLayout, comms: ParallelComms, dtype: str | torch.dtype = "bfloat16",
                 device: str | torch.device = "cuda", seed: int = 0, quantization: str = "auto",
                 cache_spec: CacheSpec | None = None) -> ShardedModel | LoadedModel:
    """This rank's shard of ``model.api.random_model(config, dtype, device, seed, quantization)``, made on
    ``device``: only this rank's experts are drawn, each layer is drawn whole but for them, quantized there
    and sliced, so the whole model never exists on one device."""
    cfg = model_config_from(config)
    layout.check(cfg.text)
    if layout.world == 1:
        loaded = random_model(cfg, dtype, device, seed, quantization, cache_spec)
        loaded.peak_host_bytes = peak_host_bytes()
        return loaded
    source = RandomSource(cfg, resolve_dtype(dtype), device, seed)
    return _build_shard(Path("random"), cfg, source, torch.device(device), layout, comms, dtype, device,
                        quantization, cache_spec)


def _narrow_experts(moe: MoE, experts: slice) -> None:
    """Make a ``MoE`` on ``meta`` hold only ``experts`` (before its storage is allocated)."""
    for name in ("w13", "w2"):
        setattr(moe, name, nn.Parameter(getattr(moe, name)[experts], requires_grad=False))


def _build_shard(path: Path, cfg, source, build: torch.device, layout: ParallelLayout, comms: ParallelComms,
                 dtype, device, quantization: str, cache_spec: CacheSpec | None) -> ShardedModel:
    """Each layer is filled on ``build`` (the host for a checkpoint), quantized on ``device`` when the mode
    asks for it (8-bit tensors of the checkpoint kept as stored), sliced, and left on ``device``."""
    torch_dtype, device, mode, cache_spec = resolve_load(cfg, source, dtype, device, quantization, cache_spec)
    with torch.device("meta"):
        model = Glm5NextModel(cfg.text, torch_dtype, cfg.has_lm_head)
    # raises CheckpointError naming every mismatch
    report = load_weights(model, cfg, _ShapesOnly(source), progress=False)
    block = weight_block(cfg)
    names = source.names()
    layout_forms = weight_layout(cfg.text, dict(model.named_parameters()), cfg.weight_prefix,
                                 "lm_head.weight" if cfg.has_lm_head else None)
    forms = {p: _choose_form(f, names)[0] for p, f in layout_forms.items()}

    def read_rows(name: str, rows: slice) -> tuple[torch.Tensor, list[RawQuantized] | None]:
        """Rows of a checkpoint tensor in float; for W8A8 int8 rows also their codes and scales as stored."""
        if source.files.get(name) is None:  # a tensor made in memory: whole, then the rows
            return read_tensor(source, name, block)[0][rows], None
        kind = source.meta(name)[1]
        with safe_open(source.files[name], framework="pt") as f:
            if kind == "I8":  # one scale per row: the rows' codes and scales are theirs alone
                q, s = f.get_slice(name)[rows.start : rows.stop], source.get(w8a8_scale_name(name))[rows]
                return q.float() * s.float()[:, None], [RawQuantized((), q, s, "w8a8")]
            if kind not in FP8_DTYPES:
                return f.get_slice(name)[rows.start : rows.stop], None
            # the [128, 128] blocks these rows lie in, then the rows themselves
            first = rows.start // block[0] * block[0]
            t = f.get_slice(name)[first : rows.stop]
        scale = source.get(scale_name(name))[first // block[0] :]
        return dequantize_block_fp8(t, scale[: -(-t.shape[0] // block[0])], block)[rows.start - first :], None

    experts = layout.experts(cfg.text.n_routed_experts)

    def fill(param: torch.Tensor, copies: list[Copy], raw: dict | None, pname: str, narrowed: bool) -> None:
        for c in copies:
            index = c.index
            if narrowed and index and isinstance(index[0], int):  # per expert: this rank's experts only
                if not experts.start <= index[0] < experts.stop:
                    continue
                index = (index[0] - experts.start, *index[1:])
            t, codes = read_tensor(source, c.name, block)
            t = t.reshape(c.shape)
            if narrowed and not index:  # packed experts: this rank's rows of them
                t = t[experts]
                codes = codes and (codes[0][experts], codes[1][experts], codes[2])
            if codes is not None and raw is not None:
                raw.setdefault(pname, []).append(RawQuantized(index, *codes))
            dest = param.data[index] if index else param.data
            dest.copy_(t.reshape(dest.shape))

    vocab = layout.rows(cfg.text.vocab_size)
    head_codes = {}
    for name in ("embed_tokens", "lm_head"):
        if getattr(model, name) is not None:
            (copy,) = forms[name]
            t, head_codes[name] = read_rows(copy.name, vocab)
            setattr(model, name, nn.Parameter(t.to(device=device, dtype=torch_dtype), requires_grad=False))
    if mode != "none":  # the head's rows, where the mode quantizes it: a rank's rows of the one-rank codes
        quantize_own_parameters(model, mode, head_codes)
    norm = read_tensor(source, forms["norm"][0].name, block)[0]
    model.norm = nn.Parameter(norm.to(device=device, dtype=torch_dtype), requires_grad=False)

    for i, layer in enumerate(model.layers):
        narrowed = isinstance(layer.mlp, MoE) and layout.ep > 1
        if narrowed:
            _narrow_experts(layer.mlp, experts)
        layer.to_empty(device=build)
        raw: dict | None = {} if mode != "none" else None
        for lname, param in layer.named_parameters():
            fill(param, forms[f"layers.{i}.{lname}"], raw, lname, narrowed and lname in ("mlp.w13", "mlp.w2"))
        if mode != "none":  # quantized where the kernels run, then sliced: a rank keeps its slice of the codes
            layer.to(device)
            quantize_model(layer, mode, raw)
        shard_layer(layer, layout, comms)
        layer.to(device)
    if device.type == "cuda":  # the float layers' memory back to the device, for the cache sized next
        torch.cuda.empty_cache()
    loaded = LoadedModel(path, cfg, model.eval(), torch_dtype, device, report, None, mode, cache_spec)
    sharded = ShardedModel(loaded, layout, comms)
    sharded.peak_host_bytes = peak_host_bytes()
    return sharded
