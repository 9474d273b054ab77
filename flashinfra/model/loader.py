"""Checkpoint loading: safetensors (single file or sharded), memory-mapped, strict.

Tensors are read one at a time from the memory-mapped files straight into the model's parameters, so no
second full copy of the model exists. Block-FP8 weights (``weight_scale_inv`` per ``[128, 128]`` block)
are dequantized on the way in. Any missing, unexpected or mis-shaped tensor is an error that names every
one of them; nothing is skipped silently. The MTP block (layer ``num_hidden_layers``) and the vision
tower are recognised and kept as a name -> file index for the parts that use them.

Two sources share that one path: ``CheckpointReader`` over safetensors files, and ``StateDictReader``
over an in-memory name -> tensor mapping (e.g. a transformers model's ``state_dict()``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from flashinfra.config import ModelConfig
from flashinfra.model.weights import Copy, Form, weight_layout
from flashinfra.progress import progress_bar
from flashinfra.quant.model import RawQuantized

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
# torch dtype -> the safetensors dtype string ``meta`` reports, so both sources describe tensors alike
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


class CheckpointError(ValueError):
    """A checkpoint does not match the model; the message names every offending tensor."""


class TensorSource(Protocol):
    """What ``load_weights`` reads from: names, their (shape, safetensors dtype), the tensors, and where
    each lives (``files``: name -> file, ``None`` for a tensor held in memory)."""

    files: Mapping[str, Path | None]

    def names(self) -> set[str]: ...

    def meta(self, name: str) -> tuple[tuple[int, ...], str]: ...

    def get(self, name: str) -> torch.Tensor: ...


class CheckpointReader:
    """Name -> tensor access over the safetensors files of a checkpoint directory."""

    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: root / f for name, f in weight_map.items()}
        else:
            shards = sorted(root.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"no safetensors files in {root}")
            self.files = {}
            for shard in shards:
                with safe_open(shard, framework="pt") as f:
                    self.files.update({name: shard for name in f.keys()})
        self._handles: dict[Path, object] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"shard {path.name} (holding {name}) is missing")
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def names(self) -> set[str]:
        return set(self.files)

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self._meta:
            sl = self._handle(name).get_slice(name)
            self._meta[name] = (tuple(sl.get_shape()), sl.get_dtype())
        return self._meta[name]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


class StateDictReader:
    """Name -> tensor access over an in-memory mapping; the tensors are read where they lie (any device)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        bad = sorted(n for n, t in tensors.items() if not isinstance(t, torch.Tensor))
        if bad:
            raise CheckpointError("state dict entries that are not tensors: " + ", ".join(bad))
        self._tensors = dict(tensors)
        self.files: dict[str, Path | None] = dict.fromkeys(self._tensors)

    def names(self) -> set[str]:
        return set(self._tensors)

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        t = self._tensors[name]
        return tuple(t.shape), SAFETENSORS_DTYPES.get(t.dtype, str(t.dtype))

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def scale_name(name: str) -> str:
    return name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def w8a8_scale_name(name: str) -> str:
    """The per-output-channel float32 scale of an int8 (W8A8) tensor: ``<name>.weight`` -> ``<name>.weight_scale``."""
    return name + "_scale"


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``w`` [..., R, C] in FP8, ``scale_inv`` [..., ceil(R/br), ceil(C/bc)] -> float32 ``w * scale``."""
    br, bc = block
    R, C = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(br, dim=-2)[..., :R, :].repeat_interleave(bc, dim=-1)[..., :C]
    return w.float() * s


def read_tensor(reader: TensorSource, name: str, block: tuple[int, int]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, str] | None]:
    """A checkpoint tensor, 8-bit ones (block-FP8, W8A8 int8) dequantized to float32; for those also their codes,
    scale and scheme as stored."""
    t = reader.get(name)
    kind = reader.meta(name)[1]
    if kind not in FP8_DTYPES and kind != "I8":
        return t, None
    scheme = "w8a8" if kind == "I8" else "fp8"
    s = reader.get(w8a8_scale_name(name) if kind == "I8" else scale_name(name))
    f = t.float() * s.float()[..., None] if kind == "I8" else dequantize_block_fp8(t, s, block)
    return f, (t, s, scheme)


@dataclass
class LoadReport:
    loaded: int  # checkpoint tensors read into parameters
    extra: dict[str, Path | None]  # recognised tensors kept for later parts (MTP, vision): name -> file


def _choose_form(forms: list[Form], names: set[str]) -> tuple[Form | None, list[str]]:
    """The first complete form, or what the most nearly complete form lacks. When other forms are just
    as incomplete (none of their tensors present, say), the last entry names their tensors too, so a
    source in either naming is told what it lacks in its own names."""
    for form in forms:
        if all(c.name in names for c in form):
            return form, []
    absent = [[c.name for c in form if c.name not in names] for form in forms]
    present = [len(form) - len(a) for form, a in zip(forms, absent)]
    best = max(range(len(forms)), key=lambda i: present[i])
    out = list(absent[best])
    for i in range(len(forms)):
        other = [n for n in absent[i] if n not in absent[best]]
        if other and present[i] == present[best]:
            more = f" and {len(other) - 3} more" if len(other) > 3 else ""
            out[-1] += f" (or instead: {', '.join(other[:3])}{more})"
    return None, out


def match_copies(layout: dict[str, list[Form]], names: set[str], reader: TensorSource
                 ) -> tuple[list[tuple[str, Copy]], list[str], list[str], set[str]]:
    """Each parameter's copies in the form the checkpoint holds, checked against their shapes and 8-bit scales ->
    (plan: (parameter, copy) pairs, missing, mis-shaped, the names accounted for: the copies, their scales and the
    present tensors of a form with some absent, which are missing, not unexpected)."""
    missing: list[str] = []
    misshaped: list[str] = []
    plan: list[tuple[str, Copy]] = []
    consumed: set[str] = set()
    for pname, forms in layout.items():
        form, absent = _choose_form(forms, names)
        if form is None:
            missing.extend(absent)
            consumed.update(c.name for f in forms for c in f if c.name in names)
            continue
        for copy in form:
            shape, dtype = reader.meta(copy.name)
            if shape != copy.shape:
                misshaped.append(f"{copy.name}: checkpoint {list(shape)}, model expects {list(copy.shape)}")
            if dtype in FP8_DTYPES:
                sname = scale_name(copy.name)
                if sname not in names:
                    missing.append(f"{sname} (scale of FP8 tensor {copy.name})")
                consumed.add(sname)
            elif dtype == "I8":
                sname = w8a8_scale_name(copy.name)
                if sname not in names:
                    missing.append(f"{sname} (scale of int8 tensor {copy.name})")
                consumed.add(sname)
            consumed.add(copy.name)
            plan.append((pname, copy))
    return plan, missing, misshaped, consumed


def _is_extra(name: str, cfg: ModelConfig) -> bool:
    mtp = f"{cfg.weight_prefix}layers.{cfg.text.num_hidden_layers}."
    return name.startswith(mtp) or name.startswith("model.visual.")


def weight_block(cfg: ModelConfig) -> tuple[int, int]:
    """The [rows, columns] blocks of a block-FP8 checkpoint's scales (``weight_block_size``, 128 x 128 if unsaid)."""
    qcfg = cfg.raw.get("quantization_config") or cfg.raw.get("text_config", {}).get("quantization_config") or {}
    return tuple(qcfg.get("weight_block_size", (128, 128)))


def load_weights(model: torch.nn.Module, cfg: ModelConfig, reader: TensorSource,
                 raw_quantized: dict[str, list[RawQuantized]] | None = None,
                 progress: bool | None = None) -> LoadReport:
    """Fill ``model``'s parameters from ``reader``. 8-bit checkpoint tensors (block-FP8, W8A8 int8) are
    dequantized into them; given ``raw_quantized``, each is also kept there as it was read, by parameter name,
    for ``flashinfra.quant.model.quantize_model`` to keep instead of re-quantizing. ``progress``: a bar over
    the tensors on stderr, naming the file being read (``None``: when stderr is a terminal)."""
    params = dict(model.named_parameters())
    head = "lm_head.weight" if cfg.has_lm_head else None
    layout = weight_layout(cfg.text, params, cfg.weight_prefix, head)
    names = reader.names()
    block = weight_block(cfg)

    plan, missing, misshaped, consumed = match_copies(layout, names, reader)
    extra = {n: reader.files[n] for n in names - consumed if _is_extra(n, cfg)}
    unexpected = sorted(names - consumed - set(extra))
    if missing or misshaped or unexpected:
        lines = [f"checkpoint does not match the {cfg.architecture} model:"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  mis-shaped: {n}" for n in misshaped]
        lines += [f"  unexpected: {n}" for n in unexpected]
        raise CheckpointError("\n".join(lines))

    files = {reader.files[copy.name] for _, copy in plan} - {None}
    bar = progress_bar(len(plan), f"loading {len(files)} file{'s' * (len(files) != 1)}" if files
                       else "loading weights", "tensor", progress)
    shown = None
    for pname, copy in plan:
        if reader.files[copy.name] != shown and reader.files[copy.name] is not None:
            shown = reader.files[copy.name]
            bar.set_postfix_str(shown.name, refresh=False)
        dest = params[pname].data[copy.index] if copy.index else params[pname].data
        t, codes = read_tensor(reader, copy.name, block)
        if codes is not None and raw_quantized is not None:
            raw_quantized.setdefault(pname, []).append(RawQuantized(copy.index, *codes))
        dest.copy_(t.reshape(dest.shape))
        bar.update(1)
    bar.close()
    return LoadReport(loaded=len(plan), extra=extra)


def load_part(model: torch.nn.Module, cfg: ModelConfig, reader: TensorSource, part: str,
              device: torch.device | str) -> None:
    """Give the parameters of ``model`` (a ``Glm5NextModel`` built on ``meta``) named ``part`` or under it
    (``"layers.3"``, ``"embed_tokens"``) storage on ``device``, filled from ``reader`` as ``load_weights`` fills
    them (8-bit tensors dequantized): a model larger than one device, held one part at a time (a reference
    computed layer by layer); ``module.to_empty(device="meta")`` frees a part again."""
    params = dict(model.named_parameters())
    layout = weight_layout(cfg.text, params, cfg.weight_prefix, "lm_head.weight" if cfg.has_lm_head else None)
    inside = {p: forms for p, forms in layout.items() if p == part or p.startswith(part + ".")}
    plan, missing, misshaped, _ = match_copies(inside, reader.names(), reader)
    if missing or misshaped or not inside:
        raise CheckpointError(f"{part}: " + ("; ".join(missing + misshaped) or "no parameter of the model"))
    block = weight_block(cfg)
    filled = {p: torch.empty(params[p].shape, dtype=params[p].dtype, device=device) for p in inside}
    for pname, copy in plan:
        dest = filled[pname][copy.index] if copy.index else filled[pname]
        dest.copy_(read_tensor(reader, copy.name, block)[0].reshape(dest.shape))
    for pname, t in filled.items():
        owner, _, leaf = pname.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(t, requires_grad=False))
