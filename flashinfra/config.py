"""Model configuration: ``config.json`` read once into frozen dataclasses.

Both forms of a GLM-5.3-Flash ``config.json`` are accepted: the nested multimodal form
(``text_config`` / ``vision_config``, ``Glm5NextForConditionalGeneration``) and the flat text-only form
(``Glm5NextTextModel``). Every default below is transformers' default for ``glm5_next``; every derived
value is resolved here and never recomputed elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

LINEAR_ATTENTION = "linear_attention"
INDEXED_ATTENTION = "indexed_attention"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # per-layer schedules, resolved to full tuples by `resolve_text_config`
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    # ---- derived values (cheap properties; the schedules above are already resolved) ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_dim(self) -> int:
        """Width of each of q, k and v in a KDA layer (heads x head_dim)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED_ATTENTION)

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """MLA layers that run their own indexer (``indexer_types == "full"``)."""
        return tuple(i for i in self.mla_layers if self.indexer_types[i] == "full")

    def indexer_source(self, layer: int) -> int:
        """The full-indexer MLA layer whose top-k selection MLA layer ``layer`` uses."""
        for i in range(layer, -1, -1):
            if self.layer_types[i] == INDEXED_ATTENTION and self.indexer_types[i] == "full":
                return i
        raise ValueError(f"layer {layer} is a shared-indexer layer with no full indexer layer before it")


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 1536
    intermediate_size: int = 4096
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = True
    projection_intermediate_size: int = 10240
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None = None
    architecture: str = "Glm5NextForConditionalGeneration"
    image_token_id: int = 154854
    video_token_id: int = 154855
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def has_lm_head(self) -> bool:
        """A bare ``Glm5NextTextModel`` checkpoint has no head: its logits use the embedding."""
        return self.architecture != "Glm5NextTextModel" and not self.text.tie_word_embeddings

    @property
    def weight_prefix(self) -> str:
        """Prefix of the text model's tensors in the checkpoint."""
        return "" if self.architecture == "Glm5NextTextModel" else "model.language_model."


def _default_layer_types(n: int) -> list[str]:
    return [LINEAR_ATTENTION if i % 4 != 3 else INDEXED_ATTENTION for i in range(n)]


def _default_indexer_types(n: int, raw: dict[str, Any]) -> list[str]:
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(raw.get("index_topk_freq", 1), 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]


def resolve_text_config(raw: dict[str, Any]) -> TextConfig:
    names = {f.name for f in fields(TextConfig)}
    kwargs = {k: v for k, v in raw.items() if k in names}
    if (lin := raw.get("linear_attn_config")) is not None:
        kwargs.setdefault("linear_head_dim", lin.get("head_dim", TextConfig.linear_head_dim))
        kwargs.setdefault("linear_num_heads", lin.get("num_heads", TextConfig.linear_num_heads))
        kwargs.setdefault("linear_conv_kernel_dim", lin.get("short_conv_kernel_size", 4))
        kwargs.setdefault("linear_lower_bound", lin.get("gate_lower_bound", -5.0))
    n = kwargs.get("num_hidden_layers", TextConfig.num_hidden_layers)
    layer_types = raw.get("layer_types") or _default_layer_types(n)
    kwargs["layer_types"] = tuple(INDEXED_ATTENTION if t == "full_attention" else t for t in layer_types)
    kwargs["mlp_layer_types"] = tuple(raw.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * (n - 3))
    kwargs["indexer_types"] = tuple(raw.get("indexer_types") or _default_indexer_types(n, raw))
    eos = raw.get("eos_token_id")
    kwargs["eos_token_id"] = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    cfg = TextConfig(**kwargs)
    _validate(cfg)
    return cfg


def _validate(cfg: TextConfig) -> None:
    n = cfg.num_hidden_layers
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):
        if len(getattr(cfg, name)) < n:
            raise ValueError(f"config: {name} has {len(getattr(cfg, name))} entries for {n} layers")
    if cfg.qk_rope_head_dim != 0:
        raise ValueError(f"config: GLM-5.3-Flash MLA has no RoPE, got qk_rope_head_dim={cfg.qk_rope_head_dim}")
    if cfg.index_kpool < 1 or cfg.index_topk % cfg.index_kpool:
        raise ValueError(f"config: index_topk {cfg.index_topk} must be a multiple of index_kpool {cfg.index_kpool}")
    if cfg.n_routed_experts % cfg.n_group:
        raise ValueError(f"config: {cfg.n_routed_experts} experts do not split into {cfg.n_group} groups")
    for i in cfg.mla_layers:
        cfg.indexer_source(i)


def resolve_config(raw: dict[str, Any]) -> ModelConfig:
    architecture = (raw.get("architectures") or ["Glm5NextForConditionalGeneration"])[0]
    if raw.get("text_config") is not None:
        text_raw = dict(raw["text_config"])
        text_raw.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    else:
        text_raw = raw
    vision = None
    if (vraw := raw.get("vision_config")) is not None:
        vnames = {f.name for f in fields(VisionConfig)}
        vraw = {k: v for k, v in vraw.items() if k in vnames}
        for k in ("patch_size", "temporal_patch_size"):
            if isinstance(vraw.get(k), (list, tuple)):
                vraw[k] = vraw[k][0]
        rope = (raw["vision_config"].get("rope_parameters") or {}).get("rope_theta")
        if rope is not None:
            vraw["rope_theta"] = float(rope)
        vision = VisionConfig(**vraw)
    return ModelConfig(
        text=resolve_text_config(text_raw),
        vision=vision,
        architecture=architecture,
        image_token_id=raw.get("image_token_id", 154854),
        video_token_id=raw.get("video_token_id", 154855),
        image_start_token_id=raw.get("image_start_token_id", 154830),
        image_end_token_id=raw.get("image_end_token_id", 154831),
        video_start_token_id=raw.get("video_start_token_id", 154832),
        video_end_token_id=raw.get("video_end_token_id", 154833),
        raw=raw,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return resolve_config(json.loads(path.read_text()))
