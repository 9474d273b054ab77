"""``load_model``: the stable entry point for tests, tools and the engine.

``load_model_from_state_dict`` builds the same model from tensors already in memory (a transformers
model's ``state_dict()``, say), through the same strict matching as a checkpoint on disk.

``LoadedModel`` bundles the model, its config and device, and offers the two calls everything else
needs: ``forward`` over a packed ``ForwardBatch`` with caller-owned caches, and ``logits`` for a list of
prompts run as one packed prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashinfra.config import ModelConfig, load_config, resolve_config
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.glm5_next import Glm5NextModel
from flashinfra.model.loader import CheckpointReader, LoadReport, StateDictReader, TensorSource, load_weights
from flashinfra.quant.cache import CacheSpec
from flashinfra.quant.model import checkpoint_format, quantize_model, resolve_mode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: Glm5NextModel
    dtype: torch.dtype
    device: torch.device
    report: LoadReport
    vision: Any = None  # the vision tower (``flashinfra.model.vision.VisionTower``) when loaded with vision=True
    quantization: str = "none"  # the weights' mode: none, w8a8 or fp8 (flashinfra.quant)
    cache_spec: CacheSpec = CacheSpec()  # cache dtypes (flashinfra.quant.cache)

    @property
    def cache_text(self):
        """The text config the cache is shaped by (a tensor-parallel rank's holds its KDA heads only)."""
        return self.config.text

    def latent_dtypes(self) -> dict[int, torch.dtype]:
        return self.cache_spec.latent_dtypes(self.config.text.mla_layers, self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, num_slots: int) -> ModelCache:
        return ModelCache.allocate(self.config.text, num_blocks, block_size, num_slots, self.dtype, self.device,
                                   self.cache_spec.state_dtype, self.latent_dtypes())

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: ModelCache,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of ``rows`` (all rows where None)."""
        hidden = self.model(input_ids, batch, cache)
        return hidden if rows is None else hidden[rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def logits(self, prompts: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
        """One ``[len, vocab]`` float32 tensor per prompt; all prompts run as one packed prefill."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("logits: every prompt needs at least one token")
        vocab = self.config.text.vocab_size
        if any(t < 0 or t >= vocab for p in prompts for t in p):
            raise ValueError(f"logits: token ids must lie in [0, {vocab})")
        tables, next_block = [], 0
        for p in prompts:
            n = (len(p) + block_size - 1) // block_size
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
        cache = self.allocate_cache(next_block, block_size, len(prompts))
        batch = ForwardBatch.build(
            [len(p) for p in prompts], [0] * len(prompts), list(range(len(prompts))), tables, block_size, self.device
        )
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=self.device)
        logits = self.compute_logits(self.forward(ids, batch, cache))
        return list(logits.split([len(p) for p in prompts]))


def resolve_load(config: ModelConfig, source: TensorSource, dtype: str | torch.dtype, device: str | torch.device,
                 quantization: str, cache_spec: CacheSpec | None) -> tuple[torch.dtype, torch.device, str, CacheSpec]:
    """(dtype, device, weight mode, cache dtypes) a load runs with; a bad combination of the checkpoint's format,
    the flags and the device is refused here, before any tensor is read."""
    from flashinfra.kernels.dispatch import use_triton

    torch_dtype, device = resolve_dtype(dtype), torch.device(device)
    qcfg = config.raw.get("quantization_config") or config.raw.get("text_config", {}).get("quantization_config") or {}
    mode = resolve_mode(quantization, checkpoint_format(source.names(), qcfg), device)
    cache_spec = cache_spec or CacheSpec()
    cache_spec.check_device(device, device.type == "cuda" and use_triton(torch.empty(0, device=device)))
    cache_spec.latent_dtypes(config.text.mla_layers, torch_dtype)  # an override naming no MLA layer fails here
    return torch_dtype, device, mode, cache_spec


def _build(path: Path, config: ModelConfig, source: TensorSource, dtype: str | torch.dtype,
           device: str | torch.device, vision: bool = False, quantization: str = "auto",
           cache_spec: CacheSpec | None = None) -> LoadedModel:
    torch_dtype, device, mode, cache_spec = resolve_load(config, source, dtype, device, quantization, cache_spec)
    with torch.device(device):
        model = Glm5NextModel(config.text, torch_dtype, config.has_lm_head)
    raw: dict | None = {} if mode != "none" else None
    report = load_weights(model, config, source, raw)
    if mode != "none":
        quantize_model(model, mode, raw)
    tower = _load_vision(config, source, torch_dtype, device) if vision else None
    return LoadedModel(path, config, model.eval(), torch_dtype, device, report, tower, mode, cache_spec)


def _load_vision(config: ModelConfig, source: TensorSource, dtype: torch.dtype, device: torch.device):
    from flashinfra.model.vision import VisionTower, load_vision_weights

    if config.vision is None:
        raise ValueError("this checkpoint has no vision tower (no vision_config); images and video need one")
    with torch.device(device):
        tower = VisionTower(config.vision).to(dtype)
    load_vision_weights(tower, source)
    return tower.eval()


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               vision: bool = False, quantization: str = "auto", cache_spec: CacheSpec | None = None) -> LoadedModel:
    """``vision=True`` also loads the vision tower (``model.visual.*``); text-only use leaves it on disk.
    ``quantization``: auto / none / w8a8 / fp8 (``flashinfra.quant.model.resolve_mode``); ``cache_spec``: the
    cache dtypes (``flashinfra.quant.cache.CacheSpec``, default: the model dtype and float32 KDA states)."""
    path = Path(path)
    return _build(path, load_config(path), CheckpointReader(path), dtype, device, vision, quantization, cache_spec)


def model_config_from(config: ModelConfig | Mapping[str, Any] | Any) -> ModelConfig:
    """A ``ModelConfig`` from itself, a ``config.json`` dict (either form) or a transformers config.

    In-memory transformers configs carry no ``architectures`` until saved; then the form decides: a
    flat text config describes a bare ``Glm5NextTextModel`` (tensors unprefixed, logits from the
    embedding), a nested one ``Glm5NextForConditionalGeneration``.
    """
    if isinstance(config, ModelConfig):
        return config
    raw = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(raw, Mapping):
        raise TypeError(f"config: expected a ModelConfig, a dict or a transformers config, got {type(config).__name__}")
    raw = dict(raw)
    if not raw.get("architectures"):
        nested = raw.get("text_config") is not None
        raw["architectures"] = ["Glm5NextForConditionalGeneration" if nested else "Glm5NextTextModel"]
    return resolve_config(raw)


def random_model(config: ModelConfig | Mapping[str, Any] | Any, dtype: str | torch.dtype = "bfloat16",
                 device: str | torch.device = "cuda", seed: int = 0, quantization: str = "auto",
                 cache_spec: CacheSpec | None = None) -> LoadedModel:
    """A model of ``config`` with random weights of plausible scales, made tensor by tensor on ``device``
    (``flashinfra.model.factory.RandomSource``): peak memory is the model's own, whatever its size."""
    from flashinfra.model.factory import RandomSource

    cfg = model_config_from(config)
    return _build(Path("random"), cfg, RandomSource(cfg, resolve_dtype(dtype), device, seed), dtype, device,
                  quantization=quantization, cache_spec=cache_spec)


def load_model_from_state_dict(config: ModelConfig | Mapping[str, Any] | Any, state_dict: Mapping[str, torch.Tensor],
                               dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                               path: str | Path = "state_dict", vision: bool = False, quantization: str = "auto",
                               cache_spec: CacheSpec | None = None) -> LoadedModel:
    """Our model from in-memory tensors, e.g. ``load_model_from_state_dict(hf.config, hf.state_dict())``.

    Names may be the release names or transformers' in-memory module names (packed experts, fused conv,
    ``forget_gate.*``); any missing, unexpected or mis-shaped tensor raises ``CheckpointError`` naming
    each, as for a checkpoint on disk. The tensors are copied into the model, so the source can be freed
    afterwards. ``path`` names the model (and is where a tokenizer would be looked for).
    """
    return _build(Path(path), model_config_from(config), StateDictReader(state_dict), dtype, device, vision,
                  quantization, cache_spec)
