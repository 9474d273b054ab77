"""Small random GLM-5.3-Flash checkpoints in the release format, and the path of the built-in default model.

``write_tiny_checkpoint`` writes ``config.json`` (nested ``text_config`` form) and ``model.safetensors``
with per-expert tensors and the release names (``q_conv1d``, ``hc_attn_fn``...), exactly what a
transformers ``save_pretrained`` writes, plus a byte-level BPE tokenizer with GLM's special tokens and
chat template. Every layer kind is present by default: KDA and MLA layers, a full and a shared
indexer, a dense MLP layer and MoE layers, mHC. ``num_nextn_predict_layers=1`` adds the MTP layer
(``flashinfra.model.mtp``), which transformers does not write.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from flashinfra.config import ModelConfig, resolve_config
from flashinfra.model.glm5_next import Glm5NextModel
from flashinfra.model.loader import SAFETENSORS_DTYPES
from flashinfra.model.weights import weight_layout

SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TINY_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16,
    qk_rope_head_dim=0, index_topk=8, index_head_dim=16, index_n_heads=16, index_kpool=4, linear_head_dim=16,
    linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=4, pad_token_id=0, tie_word_embeddings=False,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention",
                 "indexed_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
    indexer_types=["full", "full", "full", "full", "shared", "full"],
    max_position_embeddings=4096, rms_norm_eps=1e-5,
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A model reads text and writes text. "
    "The capital of France is Paris. Engines serve many requests at once, batching their tokens. "
    "Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9. "
)


def _init_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random float32 values of a plausible scale for each kind of tensor, on ``g``'s device."""
    dev = g.device
    base = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if "norm" in base or "layernorm" in base:
        return 1.0 + 0.1 * torch.randn(shape, generator=g, device=dev)
    if base == "A_log":
        return torch.empty(shape, device=dev).uniform_(1.0, 16.0, generator=g).log()
    if base in ("dt_bias", "e_score_correction_bias") or name.endswith("_base") or name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=g, device=dev)
    if name.endswith("_scale"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g, device=dev)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=g, device=dev) / math.sqrt(fan_in)


class RandomSource:
    """A ``TensorSource`` of random tensors under the release names, each made on ``device`` only when the
    loader asks for it (seeded by its name), so a model of any size loads at the memory of the model
    alone: the full-width slices and whole random models the benchmarks build on the GPU."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0):
        with torch.device("meta"):
            meta = Glm5NextModel(config.text, torch.float32, config.has_lm_head)
        head = "lm_head.weight" if config.has_lm_head else None
        layout = weight_layout(config.text, dict(meta.named_parameters()), config.weight_prefix, head)
        self._shapes = {c.name: tuple(c.shape) for forms in layout.values() for c in forms[0]}
        self.files: dict[str, Path | None] = dict.fromkeys(self._shapes)
        self.dtype, self.device, self.seed = dtype, torch.device(device), seed

    def names(self) -> set[str]:
        return set(self._shapes)

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        return self._shapes[name], SAFETENSORS_DTYPES[self.dtype]

    def get(self, name: str) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return _init_tensor(name, self._shapes[name], g).to(self.dtype)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    eos = "<|endoftext|>"
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
    }, indent=2))


def write_tiny_checkpoint(path: str | Path, seed: int = 0, tokenizer: bool = True, **overrides: Any) -> Path:
    """Write a random checkpoint (release format) with ``TINY_TEXT_CONFIG`` updated by ``overrides``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = {**TINY_TEXT_CONFIG, **overrides, "model_type": "glm5_next_text"}
    raw = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
           "tie_word_embeddings": text["tie_word_embeddings"]}
    cfg = resolve_config(raw)
    if tokenizer:
        eos = 0  # <|endoftext|> is the first special token
        text.setdefault("eos_token_id", [eos, SPECIAL_TOKENS.index("<|user|>")])
        raw["text_config"] = text
        cfg = resolve_config(raw)
    with torch.device("meta"):
        model = Glm5NextModel(cfg.text, torch.float32, cfg.has_lm_head)
    params = dict(model.named_parameters())
    layout = weight_layout(cfg.text, params, cfg.weight_prefix, "lm_head.weight" if cfg.has_lm_head else None)
    g = torch.Generator().manual_seed(seed)
    tensors = {c.name: _init_tensor(c.name, c.shape, g) for forms in layout.values() for c in forms[0]}
    if text.get("num_nextn_predict_layers"):  # transformers writes no MTP layer: ours, in the release names
        from flashinfra.model.mtp import MTPBlock, mtp_weight_layout

        with torch.device("meta"):
            mtp = MTPBlock(cfg.text, torch.float32)
        mtp_layout = mtp_weight_layout(cfg.text, dict(mtp.named_parameters()), cfg.weight_prefix)
        tensors.update({c.name: _init_tensor(c.name, c.shape, g) for forms in mtp_layout.values() for c in forms[0]})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    if tokenizer:
        write_tokenizer(path, text["vocab_size"])
    return path


def default_model_dir() -> Path:
    """The built-in default model: the small trained checkpoint shipped with the package (``train/`` made it)."""
    return Path(__file__).resolve().parent.parent / "assets" / "default-model"
