"""``flashinfra quantize --w8a8|--fp8 SRC DST``: write an 8-bit checkpoint that loads directly.

Format (release names, one ``model.safetensors``): every tensor of a quantized projection
(``flashinfra.quant.model.QUANTIZED``, and ``W8A8_ONLY`` for ``--w8a8``) in 8 bits with its scale, every other tensor
as in the source, in its float dtype (the MTP block and vision tower copied unchanged):

- ``--w8a8``: ``<name>.weight`` int8 ``[out, in]`` plus ``<name>.weight_scale`` float32 ``[out]`` (symmetric, per
  output channel: ``w = weight * weight_scale[:, None]``). Loading it with ``--quantization auto`` (or ``w8a8``)
  keeps the int8 codes as written, so its logits equal those of load-time quantization (``--quantization w8a8``)
  of the source at the same dtype.
- ``--fp8``: ``<name>.weight`` e4m3 plus ``<name>.weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]``,
  the released block-FP8 format, each tensor's blocks its own. ``--quantization fp8`` keeps them as written
  where their blocks line up with the fused projection's (``quant.model``); ``auto`` dequantizes them.

``config.json`` gains ``quantization_config`` (``quant_method`` ``w8a8`` or ``fp8``, the scheme, the quantized
and the unquantized modules). The whole model is read into host memory in float32 first: meant for checkpoints
that fit there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashinfra.model.api import load_model
from flashinfra.model.loader import CheckpointReader, scale_name, w8a8_scale_name
from flashinfra.model.weights import weight_layout
from flashinfra.quant.model import QUANTIZED, W8A8_ONLY, quantize_model, quantized_weights
from flashinfra.quant.weights import FP8_BLOCK, QuantizedWeight, quantize_fp8_blocks

NOT_QUANTIZED = ["embed_tokens", "*norm*", "mlp.gate (router)", "hc_* (mHC)", "f_b_proj", "g_b_proj",
                 "A_log", "dt_bias", "*_conv1d", "kv_b_proj", "indexer.*", "mtp layer", "model.visual.*"]
SCHEMES = {
    "w8a8": {"quant_method": "w8a8", "weights": "int8, symmetric, per output channel (weight_scale)",
             "activations": "int8, symmetric, per token, dynamic"},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK), "activation_scheme": "dynamic",
            "weights": "e4m3, one float32 scale per 128 x 128 block of each tensor (weight_scale_inv)"},
}


def quantization_config(scheme: str = "w8a8") -> dict:
    w8a8 = scheme == "w8a8"
    quantized = {**QUANTIZED, **(W8A8_ONLY if w8a8 else {})}
    kept = NOT_QUANTIZED + ([] if w8a8 else [name for names in W8A8_ONLY.values() for name in names])
    return {**SCHEMES[scheme], "quantized": {k: list(v) for k, v in quantized.items()},
            "modules_not_quantized": kept}


def _tensors(value: QuantizedWeight, part: torch.Tensor, copy, scheme: str) -> dict[str, torch.Tensor]:
    """One checkpoint tensor and its scale: ``part`` (float) of the quantized parameter ``value``."""
    if scheme == "w8a8":  # per-row scales: the rows of the parameter's codes are this tensor's codes
        return {copy.name: value.data[copy.index].reshape(copy.shape).contiguous(),
                w8a8_scale_name(copy.name): value.scale[copy.index].reshape(copy.shape[:-1]).contiguous()}
    # per-block scales: the blocks of this tensor alone, as a released checkpoint stores them
    q = quantize_fp8_blocks(part)
    return {copy.name: q.data, scale_name(copy.name): q.scale}


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str = "w8a8") -> Path:
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError("quantize: DST must differ from SRC")
    if scheme not in SCHEMES:
        raise ValueError(f"quantize: unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    loaded = load_model(src, dtype="float32", device="cpu", quantization="none")
    cfg, model = loaded.config, loaded.model
    params = dict(model.named_parameters())
    layout = weight_layout(cfg.text, params, cfg.weight_prefix, "lm_head.weight" if cfg.has_lm_head else None)
    quantize_model(model, scheme)
    quantized = quantized_weights(model)
    tensors: dict[str, torch.Tensor] = {}
    for pname, forms in layout.items():
        for copy in forms[0]:
            whole = params[pname].data
            part = (whole[copy.index] if copy.index else whole).reshape(copy.shape).contiguous()
            if pname in quantized:
                tensors.update(_tensors(quantized[pname], part, copy, scheme))
            else:
                tensors[copy.name] = part
    reader = CheckpointReader(src)
    for name in loaded.report.extra:
        tensors[name] = reader.get(name).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = quantization_config(scheme)
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    return dst
