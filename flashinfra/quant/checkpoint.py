"""``flashinfra quantize --w8a8 SRC DST``: write a W8A8 checkpoint that loads directly.

Format (release names, one ``model.safetensors``): every quantized projection (``flashinfra.quant.model.QUANTIZED``)
as ``<name>.weight`` int8 ``[out, in]`` plus ``<name>.weight_scale`` float32 ``[out]`` (symmetric, per output
channel: ``w = weight * weight_scale[:, None]``); every other tensor as in the source, in its float dtype (the
MTP block and vision tower copied unchanged). ``config.json`` gains ``quantization_config``::

    {"quant_method": "w8a8", "weights": "int8, symmetric, per output channel (weight_scale)",
     "activations": "int8, symmetric, per token, dynamic", "modules_not_quantized": [...]}

Loading it with ``--quantization auto`` (or ``w8a8``) keeps the int8 codes as written, so its logits equal those
of load-time quantization (``--quantization w8a8``) of the source at the same dtype. The whole model is read into
host memory in float32 first: meant for checkpoints that fit there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashinfra.model.api import load_model
from flashinfra.model.loader import CheckpointReader, w8a8_scale_name
from flashinfra.model.weights import weight_layout
from flashinfra.quant.model import QUANTIZED, quantize_model, quantized_weights
from flashinfra.quant.weights import QuantizedWeight

NOT_QUANTIZED = ["embed_tokens", "lm_head", "*norm*", "mlp.gate (router)", "hc_* (mHC)", "f_b_proj", "g_b_proj",
                 "A_log", "dt_bias", "*_conv1d", "kv_b_proj", "indexer.*", "mtp layer", "model.visual.*"]


def quantization_config() -> dict:
    return {"quant_method": "w8a8", "weights": "int8, symmetric, per output channel (weight_scale)",
            "activations": "int8, symmetric, per token, dynamic",
            "quantized": {k: list(v) for k, v in QUANTIZED.items()}, "modules_not_quantized": NOT_QUANTIZED}


def quantize_checkpoint(src: str | Path, dst: str | Path) -> Path:
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise ValueError("quantize: DST must differ from SRC")
    loaded = load_model(src, dtype="float32", device="cpu", quantization="none")
    cfg, model = loaded.config, loaded.model
    params = dict(model.named_parameters())
    layout = weight_layout(cfg.text, params, cfg.weight_prefix, "lm_head.weight" if cfg.has_lm_head else None)
    quantize_model(model, "w8a8")
    quantized = quantized_weights(model)
    tensors: dict[str, torch.Tensor] = {}
    for pname, forms in layout.items():
        value = quantized.get(pname, params[pname].data)
        for copy in forms[0]:
            if isinstance(value, QuantizedWeight):
                tensors[copy.name] = value.data[copy.index].reshape(copy.shape).contiguous()
                tensors[w8a8_scale_name(copy.name)] = value.scale[copy.index].reshape(copy.shape[:-1]).contiguous()
            else:
                part = value[copy.index] if copy.index else value
                tensors[copy.name] = part.reshape(copy.shape).contiguous()
    reader = CheckpointReader(src)
    for name in loaded.report.extra:
        tensors[name] = reader.get(name).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = quantization_config()
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    return dst
