"""transformers' own glm5_next classes as the reference: tiny random checkpoints and their logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashinfra.model.factory import TINY_TEXT_CONFIG

TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   projection_intermediate_size=64)
# parameters transformers initialises to constants; randomise them so a wrong use cannot hide
_SPREAD = ("A_log", "dt_bias", "base", "scale", "ape", "compress_gate", "bias", "norm", "o_norm")


def text_config(**overrides: Any) -> dict[str, Any]:
    cfg = {k: v for k, v in TINY_TEXT_CONFIG.items()}
    cfg.update(overrides)
    return cfg


def build_hf_model(text: dict[str, Any], seed: int = 0, text_only: bool = False, gain: float = 1.0,
                   spread: float = 0.3):
    """A transformers model with random weights: matrices ~ N(0, gain^2 / fan_in), constants spread."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration, Glm5NextTextConfig, Glm5NextTextModel

    torch.manual_seed(seed)
    if text_only:
        model = Glm5NextTextModel(Glm5NextTextConfig(**text))
    else:
        model = Glm5NextForConditionalGeneration(
            Glm5NextConfig(text_config=text, vision_config=TINY_VISION,
                           tie_word_embeddings=text.get("tie_word_embeddings", False)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in _SPREAD):
                p.add_(spread * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0.0, gain * p.shape[-1] ** -0.5)
    return model.eval()


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [L, V] in float32 (a bare text model's head is its embedding)."""
    x = torch.tensor([ids])
    out = model(input_ids=x)
    if hasattr(out, "logits"):
        return out.logits[0].float()
    return (out.last_hidden_state[0] @ model.embed_tokens.weight.t()).float()


@torch.no_grad()
def hf_greedy_decode(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill then ``steps`` single-token decode steps with transformers' cache; returns tokens and logits."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cache, logits = out.cache, [out.logits[0, -1].float()]
    tokens = []
    for _ in range(steps):
        tok = int(logits[-1].argmax())
        tokens.append(tok)
        out = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[0, -1].float())
    return tokens, logits


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """max |ours - ref| <= rel * max |ref| (the acceptance criterion), with a useful message."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert torch.isfinite(ours).all(), "non-finite logits"
    err = (ours.float() - ref.float()).abs()
    bound = rel * ref.float().abs().max().item()
    worst = divmod(int(err.argmax()), err.shape[-1]) if err.dim() == 2 else int(err.argmax())
    assert err.max().item() <= bound, f"max abs diff {err.max().item():.3e} > {bound:.3e} at {worst}"
