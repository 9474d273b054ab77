"""Text + image and text + video prompts: our logits against transformers' (float32, random tiny model)."""

from __future__ import annotations

import pytest
import torch

from flashinfra.multimodal.processor import image_canvas, video_canvas
from flashinfra.multimodal.prompt import IMAGE_PART, VIDEO_PART, build_prompt
from tests.model.hf_reference import assert_close
from tests.multimodal.mm_reference import (build_hf_mm_model, hf_logits_mm, our_logits, ours_from_hf,
                                           random_image, token_ids)

TOL = 1e-4


@pytest.fixture(scope="module")
def models():
    hf = build_hf_mm_model(seed=1)
    return hf, ours_from_hf(hf)


SPECIAL = {"<|begin_of_image|>": 502, "<|end_of_image|>": 503, "<|begin_of_video|>": 504, "<|end_of_video|>": 505}


def _encode(text: str) -> list[int]:
    # a stand-in tokenizer: GLM's special tokens, else one id per character in the ordinary range
    out = []
    while text:
        special = next((s for s in SPECIAL if text.startswith(s)), None)
        if special:
            out.append(SPECIAL[special])
            text = text[len(special):]
        else:
            out.append(3 + (ord(text[0]) % 400))
            text = text[1:]
    return out


def _prompt(models, text, canvases):
    hf, ours = models
    return build_prompt(text, canvases, token_ids(ours), _encode)


def test_image_prompt_logits_match_transformers(models):
    hf, ours = models
    canvases = [image_canvas(random_image(70, 130, seed=0)), image_canvas(random_image(90, 60, seed=1))]
    prompt, items = _prompt(models, f"look {IMAGE_PART} and {IMAGE_PART} now", canvases)
    assert [it.num_embeds for it in items] == [c.num_embeds for c in canvases]
    assert_close(our_logits(ours, prompt, items), hf_logits_mm(hf, prompt, items), TOL)


def test_video_prompt_logits_match_transformers(models):
    hf, ours = models
    frames = [random_image(60, 90, seed=10 + i) for i in range(5)]  # odd: the last frame is repeated
    canvas = video_canvas(frames, fps=2.0, frame_indices=[0, 1, 2, 3, 4])
    assert canvas.grid[0] == 3 and canvas.timestamps == (0.0, 1.0, 2.0)
    prompt, items = _prompt(models, f"clip {VIDEO_PART} what happens?", [canvas])
    assert_close(our_logits(ours, prompt, items), hf_logits_mm(hf, prompt, items), TOL)


def test_image_and_video_in_one_prompt(models):
    hf, ours = models
    image = image_canvas(random_image(50, 50, seed=3))
    video = video_canvas([random_image(40, 70, seed=20 + i) for i in range(4)], fps=4.0)
    prompt, items = _prompt(models, f"{VIDEO_PART} then {IMAGE_PART}?", [video, image])
    assert_close(our_logits(ours, prompt, items), hf_logits_mm(hf, prompt, items), TOL)


def test_wrong_image_changes_logits(models):
    """The check can fail: another image of the same size gives other logits."""
    hf, ours = models
    a = _prompt(models, f"x {IMAGE_PART} y", [image_canvas(random_image(70, 70, seed=5))])
    b = _prompt(models, f"x {IMAGE_PART} y", [image_canvas(random_image(70, 70, seed=6))])
    assert a[0] == b[0]
    with pytest.raises(AssertionError):
        assert_close(our_logits(ours, *a), hf_logits_mm(hf, *b), TOL)


def test_tower_matches_transformers_on_mixed_and_equal_sizes(models):
    """The tower alone, frames of one size (the batched view path) and of several (the gathered path)."""
    hf, ours = models
    for grids in ([(1, 4, 6)] * 3, [(1, 4, 6), (2, 8, 4), (1, 2, 2)]):
        patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14)
        with torch.no_grad():
            ref = hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
        assert_close(torch.cat(ours.vision(patches, grids)), ref, TOL)


def test_vision_loading_is_strict(models):
    from flashinfra.model.api import load_model_from_state_dict
    from flashinfra.model.loader import CheckpointError

    hf, _ = models
    sd = dict(hf.state_dict())
    sd.pop("model.visual.blocks.0.attn.q_norm.weight")
    sd["model.visual.blocks.0.attn.rope_scale"] = torch.ones(1)
    sd["model.visual.merger.proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError) as info:
        load_model_from_state_dict(hf.config, sd, vision=True)
    msg = str(info.value)
    assert "missing: model.visual.blocks.0.attn.q_norm.weight" in msg
    assert "unexpected: model.visual.blocks.0.attn.rope_scale" in msg and "mis-shaped: model.visual.merger.proj" in msg
    assert load_model_from_state_dict(hf.config, sd).vision is None  # text only: the tower is not read
