"""A tiny random ``Glm5NextForConditionalGeneration`` with image/video token ids inside its vocabulary, and
our logits for a prompt with images/videos through the engine's own path (embedder + text model)."""

from __future__ import annotations

import numpy as np
import torch

from flashinfra.model.api import load_model_from_state_dict
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.multimodal.encoder import MultiModalEmbedder
from flashinfra.multimodal.prompt import TokenIds
from tests.model.hf_reference import TINY_VISION, _SPREAD, text_config

# the tiny vocabulary (512) ends with GLM's multimodal special tokens
MM_IDS = dict(image_token_id=500, video_token_id=501, image_start_token_id=502, image_end_token_id=503,
              video_start_token_id=504, video_end_token_id=505)


def build_hf_mm_model(seed: int = 0, spread: float = 0.3, **text_overrides):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text_config(**text_overrides),
                                                            vision_config=TINY_VISION, **MM_IDS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in _SPREAD):
                p.add_(spread * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model.eval()


def ours_from_hf(hf):
    return load_model_from_state_dict(hf.config, hf.state_dict(), vision=True)


def token_ids(loaded) -> TokenIds:
    return TokenIds.from_config(loaded.config)


def random_image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


class _Sched:
    """The fields of a ``ScheduledRequest`` the embedder reads."""

    def __init__(self, prompt, items, context_len=0, n=None):
        self.prompt_token_ids, self.mm_items, self.context_len = prompt, tuple(items), context_len
        self.num_new_tokens = len(prompt) - context_len if n is None else n


@torch.no_grad()
def our_logits(loaded, prompt: list[int], items) -> torch.Tensor:
    """[len, vocab] float32, one packed prefill with the embedder filling the placeholders."""
    embedder = MultiModalEmbedder(loaded.vision, loaded.model.embed_tokens, loaded.config.image_token_id, 2**30)
    bs = 16
    nb = -(-len(prompt) // bs)
    cache = loaded.allocate_cache(nb, bs, 1)
    batch = ForwardBatch.build([len(prompt)], [0], [0], [list(range(nb))], bs, loaded.device)
    ids = torch.tensor(prompt, dtype=torch.long)
    x = embedder.embed(ids, [_Sched(prompt, items)])
    return loaded.compute_logits(loaded.model(ids, batch, cache, inputs_embeds=x))


@torch.no_grad()
def hf_logits_mm(hf, prompt: list[int], items) -> torch.Tensor:
    from flashinfra.multimodal.encoder import item_patches

    kw = {}
    images = [it for it in items if it.kind == "image"]
    videos = [it for it in items if it.kind == "video"]
    if images:
        kw["pixel_values"] = torch.cat([item_patches(it, torch.device("cpu")) for it in images])
        kw["image_grid_thw"] = torch.tensor([list(it.grid) for it in images])
    if videos:
        kw["pixel_values_videos"] = torch.cat([item_patches(it, torch.device("cpu")) for it in videos])
        kw["video_grid_thw"] = torch.tensor([list(it.grid) for it in videos])
    return hf(input_ids=torch.tensor([prompt]), **kw).logits[0].float()


# the built-in default model's tokenizer (GLM's special tokens at 4069..4095)
DEFAULT_MM_IDS = dict(image_token_id=4083, video_token_id=4084, image_start_token_id=4079, image_end_token_id=4080,
                      video_start_token_id=4081, video_end_token_id=4082)


def write_mm_checkpoint(path, seed: int = 0):
    """A random tiny multimodal checkpoint saved by transformers, with the default model's tokenizer."""
    import shutil

    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from flashinfra.model.factory import default_model_dir

    torch.manual_seed(seed)
    text = text_config(vocab_size=4096, eos_token_id=[4069])
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=TINY_VISION,
                                                            **DEFAULT_MM_IDS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in _SPREAD):
                p.add_(0.3 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.eval().save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / f, path / f)
    return model.eval()
