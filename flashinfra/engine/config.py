"""``EngineConfig``: how one engine is built (model, cache size, batching limits), resolved once.

Pure data, no torch, so the server can build it from its command line and send it to the engine
process. ``parse_memory`` reads sizes such as ``"2GiB"`` or ``"512MB"`` for ``--kv-cache-memory``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_memory(text: str | int) -> int:
    """Bytes in ``text`` (``"2GiB"``, ``"512MB"``, ``"1e9"``, ``4096``)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read a memory size from {text!r} (examples: 2GiB, 512MB, 1000000)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the built-in default model
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda when available
    block_size: int = 16
    num_blocks: int | None = None  # paged cache blocks; None: from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for blocks + KDA slots; None: a device-dependent default
    max_num_seqs: int = 64  # batch-size cap, and the number of KDA state slots
    max_num_batched_tokens: int = 2048  # token budget per step
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped by the cache)
    max_prefill_chunk: int = 0  # most tokens one request takes in a step (0: the whole budget)
    prefix_cache_slots: int | None = None  # KDA checkpoints kept for prefix caching (None: max_num_seqs; 0: off)
    prefix_checkpoint_interval: int = 1024  # tokens between prompt checkpoints (plus one at the prompt's end)
    seed: int = 0  # seeds the generators of requests that give no seed
    events_path: str | None = None  # JSONL runtime events (flashinfra.feedback.events)
    gil_probe_ms: float | None = None  # report GIL stalls longer than this (flashinfra.feedback.gil_probe)
    quantization: str = "auto"  # weights: auto (the checkpoint's), none, w8a8, fp8 (flashinfra.quant.model)
    kv_cache_dtype: str = "auto"  # MLA latent cache: auto (the model dtype), bfloat16, fp8, int8 (+ per-token scale)
    kv_cache_dtype_layers: str | None = None  # per-layer latent dtype overrides, e.g. "first:bfloat16,last:bfloat16"
    kda_state_dtype: str = "float32"  # KDA recurrent state: float32 or bfloat16

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefix_checkpoint_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache_slots is not None and self.prefix_cache_slots < 0:
            raise ValueError(f"prefix_cache_slots must be >= 0, got {self.prefix_cache_slots}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16")
        for name, choices in (("quantization", ("auto", "none", "w8a8", "fp8")),
                              ("kv_cache_dtype", ("auto", "bfloat16", "fp8", "int8")),
                              ("kda_state_dtype", ("float32", "bfloat16"))):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(choices)}")

    @property
    def resolved_prefix_slots(self) -> int:
        return self.max_num_seqs if self.prefix_cache_slots is None else self.prefix_cache_slots
