"""Quantizing a loaded model in place, and refusing the combinations that cannot work.

``QUANTIZED`` lists the projections that become 8-bit: every dense projection of KDA (``in_proj``, ``o_proj``),
MLA (``qkv_a_proj``, ``q_b_proj``, ``o_proj``), the dense MLPs and the experts (routed and shared); W8A8 also
quantizes ``lm_head`` (``W8A8_ONLY``: the largest single weight a decode step reads; one scale per vocabulary row, so
a tensor-parallel rank's rows are exactly its slice of it, which FP8's 128-row blocks are not where the vocabulary
splits off a block boundary). A model whose head is its embedding keeps it in the model dtype. What stays in the
model dtype: the embeddings (and ``lm_head`` under FP8), every norm, the router, mHC, the KDA forget/output gate
low-rank up-projections (``fg_b_proj``) and ``A_log`` / ``dt_bias``, the conv weights, MLA's ``kv_b_proj`` (absorbed
into the query and output per head, an einsum rather than a GEMM of the model width) and the DSA indexer (its top-k
choice is the most sensitive to rounding). ``in_proj`` carries beta's and the gates' low-rank inputs as rows: each row
has its own scale, so they are quantized with it.

Where the checkpoint already holds the 8-bit form (block-FP8 ``weight_scale_inv`` with ``--quantization fp8``,
W8A8 ``weight_scale`` with ``w8a8``), the loader hands the raw tensors over (``RawQuantized``) and they are kept
as they are; otherwise the model's float weights are quantized here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from flashinfra.quant.weights import (FP8_BLOCK, QuantizedWeight, quantize_fp8_blocks, quantize_int8_per_channel)

MODES = ("auto", "none", "w8a8", "fp8")
# module class name -> its quantized parameters
QUANTIZED = {
    "KDAttention": ("in_proj", "o_proj"),
    "MLAttention": ("qkv_a_proj", "q_b_proj", "o_proj"),
    "DenseMLP": ("gate_up_proj", "down_proj"),
    "MoE": ("w13", "w2"),
}
W8A8_ONLY = {"Glm5NextModel": ("lm_head",)}


class QuantizationError(ValueError):
    """A quantization mode that does not fit the checkpoint or the device; the message names both."""


@dataclass
class RawQuantized:
    """One checkpoint tensor already in 8-bit form, as the loader found it, bound for ``param[index]``."""
    index: tuple
    data: torch.Tensor  # int8 [rows, K] or e4m3 [rows, K]
    scale: torch.Tensor  # [rows] (w8a8) or [ceil(rows/bn), ceil(K/bk)] (fp8)
    scheme: str


def checkpoint_format(names: set[str], quantization_config: dict) -> str:
    """``"w8a8"``, ``"fp8"`` or ``"bf16"`` (any float format), from the tensor names and ``quantization_config``."""
    method = (quantization_config or {}).get("quant_method")
    if method == "w8a8" or any(n.endswith(".weight_scale") for n in names):
        return "w8a8"
    if method == "fp8" or any(n.endswith("weight_scale_inv") for n in names):
        return "fp8"
    return "bf16"


def resolve_mode(mode: str, fmt: str, device: torch.device | str) -> str:
    """The mode to run (``none``, ``w8a8`` or ``fp8``) for ``--quantization mode`` on a checkpoint of format
    ``fmt``, or a ``QuantizationError`` naming both. ``auto`` keeps a W8A8 checkpoint in W8A8 and runs anything
    else unquantized (block-FP8 dequantized at load, as without this package)."""
    if mode not in MODES:
        raise QuantizationError(f"unknown --quantization {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "w8a8" if fmt == "w8a8" else "none"
    if fmt == "w8a8" and mode != "w8a8":
        raise QuantizationError(f"the checkpoint is W8A8 (int8 weights with weight_scale) but --quantization is "
                                f"{mode}: load it with --quantization w8a8 (or auto)")
    if fmt == "fp8" and mode == "w8a8":
        raise QuantizationError("the checkpoint is block-FP8 (weight_scale_inv) but --quantization is w8a8: "
                                "re-quantizing FP8 weights to int8 rounds twice; use --quantization fp8, or none "
                                "to dequantize them")
    device = torch.device(device)
    if mode == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise QuantizationError(f"--quantization fp8 needs FP8 tensor cores (sm_89 or newer); device {device} is "
                                f"sm_{cap.replace('.', '')}: use --quantization w8a8 or none")
    return mode


def _block_rows(index: tuple, bn: int) -> tuple:
    """A row index of a weight (``()``, ``(slice,)``, ``(e,)``, ``(e, slice)``) as an index of its block scales,
    or None when the rows do not start and end on block boundaries."""
    out = []
    for i in index:
        if isinstance(i, slice):
            if i.start % bn:
                return None
            out.append(slice(i.start // bn, -(-i.stop // bn)))
        else:
            out.append(i)
    return tuple(out)


def _from_raw(param: torch.Tensor, parts: list[RawQuantized], scheme: str) -> QuantizedWeight | None:
    """The parameter assembled from checkpoint tensors already in ``scheme``, or None when they do not cover it
    (some parts in float) or (fp8) their blocks do not line up with the parameter's."""
    if not parts or any(p.scheme != scheme for p in parts):
        return None
    covered = torch.zeros(param.shape[:-1], dtype=torch.bool)
    for p in parts:
        covered[p.index] = True
    if not bool(covered.all()):
        return None
    dev = param.device
    if scheme == "w8a8":
        data = torch.empty(param.shape, dtype=torch.int8, device=dev)
        scale = torch.empty(param.shape[:-1], dtype=torch.float32, device=dev)
        for p in parts:
            data[p.index] = p.data.to(dev).reshape(data[p.index].shape)
            scale[p.index] = p.scale.to(dev, torch.float32).reshape(scale[p.index].shape)
        return QuantizedWeight(data, scale, "w8a8")
    bn, bk = FP8_BLOCK
    N, K = param.shape[-2:]
    data = torch.empty(param.shape, dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.empty(*param.shape[:-2], -(-N // bn), -(-K // bk), dtype=torch.float32, device=dev)
    for p in parts:
        rows = _block_rows(p.index, bn)
        if rows is None or p.data.dtype != torch.float8_e4m3fn:
            return None
        data[p.index] = p.data.to(dev).reshape(data[p.index].shape)
        target = scale[rows] if rows else scale
        if tuple(target.shape) != tuple(p.scale.shape):
            return None
        target.copy_(p.scale.to(dev, torch.float32))
    return QuantizedWeight(data, scale, "fp8", FP8_BLOCK)


def _quantize(param: torch.Tensor, scheme: str, raw: list[RawQuantized] | None) -> QuantizedWeight:
    kept = _from_raw(param, raw or [], scheme)
    if kept is not None:
        return kept
    return quantize_int8_per_channel(param) if scheme == "w8a8" else quantize_fp8_blocks(param)


def _replace(module: nn.Module, name: str, value) -> None:
    """Swap a parameter for a ``QuantizedWeight`` (a plain attribute: it holds int8/fp8 storage and scales)."""
    del module._parameters[name]
    object.__setattr__(module, name, value)


def quantize_model(model: nn.Module, scheme: str, raw: dict[str, list[RawQuantized]] | None = None) -> int:
    """Quantize ``model``'s projections in place (see ``QUANTIZED``); -> the number of weights quantized.

    ``raw`` maps a parameter name to the checkpoint tensors already in 8-bit form that fill it. A MoE's shared
    expert of the routed experts' width is stacked after them, so that one grouped launch serves both."""
    raw = raw or {}
    count = 0
    # a MoE's shared expert goes with its experts (stacked with them, or left in float with them)
    shared = {id(m.shared) for m in model.modules() if type(m).__name__ == "MoE"}
    for mname, module in list(model.named_modules()):
        if id(module) in shared:
            continue
        prefix = f"{mname}." if mname else ""
        if type(module).__name__ == "MoE":
            count += _quantize_moe(module, scheme, raw, prefix)
        else:
            count += quantize_own_parameters(module, scheme, raw, prefix)
    return count


def quantize_own_parameters(module: nn.Module, scheme: str, raw: dict[str, list[RawQuantized]] | None = None,
                            prefix: str = "") -> int:
    """Quantize those of ``module``'s own parameters (not its children's) that ``scheme`` quantizes (``QUANTIZED``,
    ``W8A8_ONLY``); ``raw`` as for ``quantize_model``, its names under ``prefix``. -> how many."""
    cls = type(module).__name__
    count = 0
    for name in QUANTIZED.get(cls, ()) + (W8A8_ONLY.get(cls, ()) if scheme == "w8a8" else ()):
        p = module._parameters.get(name)
        if p is not None:
            _replace(module, name, _quantize(p.data, scheme, (raw or {}).get(prefix + name)))
            count += 1
    return count


def _quantize_moe(moe: nn.Module, scheme: str, raw: dict, prefix: str) -> int:
    shared = moe.shared
    w13, w2 = moe._parameters["w13"].data, moe._parameters["w2"].data
    s13, s2 = shared._parameters["gate_up_proj"].data, shared._parameters["down_proj"].data
    q = {n: _quantize(t, scheme, raw.get(prefix + n)) for n, t in
         (("w13", w13), ("w2", w2), ("shared.gate_up_proj", s13), ("shared.down_proj", s2))}
    _replace(shared, "gate_up_proj", q["shared.gate_up_proj"])
    _replace(shared, "down_proj", q["shared.down_proj"])
    if s13.shape == w13.shape[1:] and s2.shape == w2.shape[1:]:
        for n, sn in (("w13", "shared.gate_up_proj"), ("w2", "shared.down_proj")):
            a, b = q[n], q[sn]
            q[n] = QuantizedWeight(torch.cat([a.data, b.data[None]]), torch.cat([a.scale, b.scale[None]]), scheme,
                                   a.block)
        # the shared expert as views of the stacked last expert: one storage
        shared.gate_up_proj, shared.down_proj = q["w13"][-1], q["w2"][-1]
    _replace(moe, "w13", q["w13"])
    _replace(moe, "w2", q["w2"])
    return 4


def shared_is_stacked(w13, shared_w13) -> bool:
    """The shared expert's weights are views of the routed weights' last expert, as ``_quantize_moe`` stacks
    them (the view's base, not its address: tensors on the meta device, for sizing, all have address 0)."""
    return (isinstance(w13, QuantizedWeight) and isinstance(shared_w13, QuantizedWeight)
            and shared_w13.data.dim() == 2 and shared_w13.data._base is w13.data
            and shared_w13.data.storage_offset() == w13.data[-1].storage_offset())


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """Every ``QuantizedWeight`` of ``model`` by its parameter name (a stacked shared expert included)."""
    out = {}
    for mname, module in model.named_modules():
        for name, v in vars(module).items():
            if isinstance(v, QuantizedWeight):
                out[f"{mname}.{name}" if mname else name] = v
    return out
