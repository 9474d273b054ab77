"""Cache dtypes: the MLA latent per layer in the model dtype, bf16, fp8 (e4m3) or int8 with one float32 scale per
token; the KDA recurrent state in float32 or bf16 (the conv state stays in the model dtype).

``CacheSpec`` is the resolved choice (``--kv-cache-dtype``, ``--kda-state-dtype`` and per-layer overrides such as
``first:bfloat16,last:bfloat16`` or ``3:bfloat16``). ``write_latent`` quantizes a layer's new latent rows on the way
into the cache (scale ``amax / 127`` or ``amax / 448`` per token), ``read_latent`` dequantizes one sequence's
rows for the reference path; the Triton path reads the 8-bit cache directly (``kernels.sparse_mla``).
``norm_latent`` forms the latent (the kv_a norm) and stores it in one launch where the cache is in the
rows' dtype. ``tokens_per_gib`` is the cache capacity that the choice buys. The KDA state's dtype is the allocation's
(``ModelCache``): the kernels (decode, prefill, checkpoints, verify) and the references read it into float32 and
round to it where they store.

The DSA indexer keys (key | gate score per token) follow their layer's latent: where it is 8-bit they are stored
in e4m3 with one float32 scale per half (``write_index_entries`` / ``read_index_entries``), else in the model dtype.
``write_index_entries`` also writes the key of every pool a new token completes into the layer's pool-key cache
(model dtype, ``kernels.dsa_pool_keys``), which the Triton path scores (``kernels.dsa_indexer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.dsa_entries import write_entries_launch
from flashinfra.kernels.dsa_pool_keys import dequant_entries, write_pool_keys
from flashinfra.kernels.norms import rms_norm, rms_norm_to_slots_launch
from flashinfra.kernels.quant import quant_fp8_per_group, quant_int8_per_token

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "int8")
STATE_DTYPES = ("float32", "bfloat16")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8,
                "float32": torch.float32}
QUANTIZED_LATENT = (torch.int8, torch.float8_e4m3fn)


class CacheDtypeError(ValueError):
    """A cache dtype that does not exist or does not fit the device; the message names both."""


def parse_layer_overrides(text: str | None) -> tuple[tuple[str, str], ...]:
    """``"first:bfloat16,last:bfloat16,7:fp8"`` -> ``(("first", "bfloat16"), ("last", "bfloat16"), ("7", "fp8"))``."""
    if not text:
        return ()
    out = []
    for part in text.split(","):
        layer, _, dtype = part.strip().partition(":")
        if not dtype or dtype not in KV_CACHE_DTYPES or not (layer in ("first", "last") or layer.isdigit()):
            raise CacheDtypeError(f"cannot read the cache dtype override {part!r}: expected LAYER:DTYPE with LAYER "
                                  f"an MLA layer index, first or last, and DTYPE one of {', '.join(KV_CACHE_DTYPES)}")
        out.append((layer, dtype))
    return tuple(out)


@dataclass(frozen=True)
class CacheSpec:
    kv_cache_dtype: str = "auto"  # every MLA layer's latent: auto (the model dtype), bfloat16, fp8, int8
    kda_state_dtype: str = "float32"
    layer_overrides: tuple[tuple[str, str], ...] = ()  # (MLA layer index | "first" | "last", dtype)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise CacheDtypeError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}; choose one of "
                                  f"{', '.join(KV_CACHE_DTYPES)}")
        if self.kda_state_dtype not in STATE_DTYPES:
            raise CacheDtypeError(f"unknown --kda-state-dtype {self.kda_state_dtype!r}; choose one of "
                                  f"{', '.join(STATE_DTYPES)}")

    @staticmethod
    def from_flags(kv_cache_dtype: str = "auto", kda_state_dtype: str = "float32",
                   layers: str | None = None) -> "CacheSpec":
        return CacheSpec(kv_cache_dtype, kda_state_dtype, parse_layer_overrides(layers))

    @staticmethod
    def of(config) -> "CacheSpec":
        """The cache dtypes a ``LoadConfig`` (or ``EngineConfig``) asks for."""
        return CacheSpec.from_flags(config.kv_cache_dtype, config.kda_state_dtype, config.kv_cache_dtype_layers)

    @property
    def state_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.kda_state_dtype]

    def latent_dtypes(self, mla_layers: tuple[int, ...], model_dtype: torch.dtype) -> dict[int, torch.dtype]:
        """Every MLA layer's latent dtype. An override naming a layer that is not an MLA layer is an error."""
        names = {i: self.kv_cache_dtype for i in mla_layers}
        for layer, dtype in self.layer_overrides:
            i = mla_layers[0] if layer == "first" else mla_layers[-1] if layer == "last" else int(layer)
            if i not in names:
                raise CacheDtypeError(f"cache dtype override {layer}:{dtype}: layer {i} is not an MLA layer "
                                      f"(MLA layers: {list(mla_layers)})")
            names[i] = dtype
        return {i: model_dtype if d == "auto" else TORCH_DTYPES[d] for i, d in names.items()}

    def check_device(self, device: torch.device | str, kernels: bool) -> None:
        """Refuse what the device's kernels cannot run. ``kernels``: the Triton path runs (CUDA, not forced onto the
        references). Either KDA state dtype runs everywhere: every KDA kernel reads a bf16 state into float32 and
        rounds where it stores it."""
        device = torch.device(device)
        uses_fp8 = self.kv_cache_dtype in ("fp8", "int8") or any(d in ("fp8", "int8") for _, d in self.layer_overrides)
        if uses_fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise CacheDtypeError(f"an 8-bit cache (--kv-cache-dtype fp8 or int8: the indexer keys go to fp8 with "
                                  f"either) needs e4m3 conversions (sm_89 or newer); device {device} is older: use "
                                  "bfloat16")


def latent_bytes_per_token(width: int, dtype: torch.dtype) -> int:
    """One token's latent bytes: the row, plus its float32 scale when the row is 8-bit."""
    return width * torch.empty((), dtype=dtype).element_size() + (4 if dtype in QUANTIZED_LATENT else 0)


def index_bytes_per_token(head_dim: int, latent_dtype: torch.dtype, model_dtype: torch.dtype) -> int:
    """One token's indexer entry (key | gate score): e4m3 plus two float32 scales beside an 8-bit latent."""
    if latent_dtype in QUANTIZED_LATENT:
        return 2 * head_dim + 8
    return 2 * head_dim * torch.empty((), dtype=model_dtype).element_size()


def write_index_entries(cache, layer: int, slot_mapping: torch.Tensor, entries: torch.Tensor,
                        pool_ape: torch.Tensor) -> None:
    """Store new indexer entries [T, 2 Di] (key | gate score), in e4m3 with a scale per half where the layer's
    indexer cache is fp8, then the key of every pool a new token completes (``pool_ape`` [kpool, Di]: the
    indexer's pool position bias) where the cache keeps pool keys for the layer."""
    keys = cache.indexer_keys[layer]
    flat = keys.view(-1, keys.shape[-1])
    if layer not in cache.indexer_scale:
        flat[slot_mapping] = entries.to(keys.dtype)
    else:
        q, s = quant_fp8_per_group(entries, keys.shape[-1] // 2)
        flat[slot_mapping] = q
        cache.indexer_scale[layer].view(-1, 2)[slot_mapping] = s
    _pool_keys(cache, layer, slot_mapping, pool_ape)


def write_index_rows(cache, layer: int, slot_mapping: torch.Tensor, kg: torch.Tensor, indexer) -> None:
    """``write_index_entries`` of the entries ``indexer.entries_of(kg)`` forms from the key | gate score rows ``kg``;
    the norm and the store in one launch where the cache is in the rows' dtype on the kernel path."""
    keys = cache.indexer_keys[layer]
    if layer in cache.indexer_scale or keys.dtype != kg.dtype or not use_triton(kg, keys):
        write_index_entries(cache, layer, slot_mapping, indexer.entries_of(kg), indexer.pool_ape)
        return
    write_entries_launch(kg, indexer.k_norm_weight, indexer.k_norm_bias, indexer.K_NORM_EPS,
                         keys.view(-1, keys.shape[-1]), slot_mapping)
    _pool_keys(cache, layer, slot_mapping, indexer.pool_ape)


def _pool_keys(cache, layer: int, slot_mapping: torch.Tensor, pool_ape: torch.Tensor) -> None:
    """The key of every pool a new token completes, where the cache keeps pool keys for the layer (``pool_ape``
    [kpool, Di]: the indexer's pool position bias), from the entries just stored."""
    if layer in cache.indexer_pool_keys:
        write_pool_keys(cache.indexer_keys[layer], cache.indexer_scale.get(layer), pool_ape, slot_mapping,
                        cache.indexer_pool_keys[layer])


def read_index_entries(cache, layer: int, blocks: tuple[int, ...], n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` indexer entries of one sequence in ``dtype`` -> [n, 2 Di]."""
    keys = cache.indexer_keys[layer]
    rows = keys[list(blocks)].flatten(0, 1)[:n]
    scale = cache.indexer_scale.get(layer)
    return dequant_entries(rows, None if scale is None else scale[list(blocks)].flatten(0, 1)[:n], dtype)


def write_latent(cache, layer: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Store new latent ``rows`` [T, R] at ``slot_mapping`` [T], quantized per token where the layer's cache is
    8-bit."""
    latent = cache.mla_latent[layer]
    flat = latent.view(-1, latent.shape[-1])
    if latent.dtype not in QUANTIZED_LATENT:
        flat[slot_mapping] = rows.to(latent.dtype)
        return
    if latent.dtype == torch.int8:
        q, s = quant_int8_per_token(rows)
    else:
        R = rows.shape[-1]
        q, s = quant_fp8_per_group(rows, 1 << (R - 1).bit_length())  # one group spanning the row
        s = s[:, 0]
    flat[slot_mapping] = q
    cache.mla_latent_scale[layer].view(-1)[slot_mapping] = s


def norm_latent(cache, layer: int, slot_mapping: torch.Tensor, kv_a: torch.Tensor, weight: torch.Tensor,
                eps: float) -> torch.Tensor:
    """The new tokens' latent, ``rms_norm`` of their ``kv_a`` rows [T, R], stored at ``slot_mapping`` as
    ``write_latent`` stores it -> the rows; one launch for a cache in their dtype on the kernel path."""
    latent = cache.mla_latent[layer]
    if latent.dtype == kv_a.dtype and use_triton(kv_a, latent):
        return rms_norm_to_slots_launch(kv_a, weight, eps, latent.view(-1, latent.shape[-1]), slot_mapping)
    rows = rms_norm(kv_a, weight, eps)
    write_latent(cache, layer, slot_mapping, rows)
    return rows


def read_latent(cache, layer: int, blocks: tuple[int, ...], n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` latent rows of one sequence, dequantized to ``dtype`` -> [n, R]."""
    latent = cache.mla_latent[layer]
    rows = latent[list(blocks)].flatten(0, 1)[:n]
    if latent.dtype not in QUANTIZED_LATENT:
        return rows.to(dtype)
    s = cache.mla_latent_scale[layer][list(blocks)].flatten()[:n]
    ct = torch.promote_types(dtype, torch.float32)
    return (rows.to(ct) * s.to(ct)[:, None]).to(dtype)


def pool_key_bytes(cfg, tokens: int, dtype: torch.dtype) -> int:
    """The pool-key cache's bytes for ``tokens`` tokens of every full-indexer layer (``tokens`` need not be a
    multiple of ``index_kpool``: a fraction of a pool per token, for sizing)."""
    size = torch.empty((), dtype=dtype).element_size()
    return len(cfg.indexer_layers) * cfg.index_head_dim * size * tokens // cfg.index_kpool


def tokens_per_gib(cfg, spec: CacheSpec, model_dtype: torch.dtype) -> dict:
    """Cache tokens one GiB holds for ``cfg`` (a ``TextConfig``): the paged part (MLA latents + indexer entries + the
    indexer's pool keys, a fraction of a pool per token) per token, and the KDA state bytes per sequence that come on
    top."""
    lat = spec.latent_dtypes(cfg.mla_layers, model_dtype)
    latent = sum(latent_bytes_per_token(cfg.kv_lora_rank, d) for d in lat.values())
    index = sum(index_bytes_per_token(cfg.index_head_dim, lat[i], model_dtype) for i in cfg.indexer_layers)
    H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    state = len(cfg.kda_layers) * (H * K * K * torch.empty((), dtype=spec.state_dtype).element_size()
                                   + 3 * cfg.linear_dim * (W - 1) * torch.empty((), dtype=model_dtype).element_size())
    pool = pool_key_bytes(cfg, 1, model_dtype)
    return dict(latent_bytes_per_token=latent, indexer_bytes_per_token=index, pool_key_bytes_per_token=pool,
                latent_tokens_per_gib=2**30 // latent, paged_tokens_per_gib=2**30 // (latent + index + pool),
                kda_state_bytes_per_seq=state)
