"""Images through the engine: greedy output against transformers, the encoder cache and prefix caching
give the cold outputs, different images of one size share no prefix, chunked prefill may split an image."""

from __future__ import annotations

import pytest
import torch

from flashinfra import LLM, SamplingParams
from tests.multimodal.mm_reference import random_image, write_mm_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mm")
    hf = write_mm_checkpoint(path, seed=2)
    return path, hf


def _llm(path, **kw):
    args = dict(enable_vision=True, num_blocks=256, block_size=16, max_num_seqs=4, prefix_checkpoint_interval=16)
    args.update(kw)
    return LLM(path, **args)


@torch.no_grad()
def _hf_greedy(hf, prompt_ids, items, steps):
    from tests.multimodal.mm_reference import hf_logits_mm

    ids, out = list(prompt_ids), []
    for _ in range(steps):
        tok = int(hf_logits_mm(hf, ids, items)[-1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_image_generation_matches_transformers(ckpt):
    path, hf = ckpt
    llm = _llm(path)
    img = random_image(80, 110, seed=0)
    out = llm.generate("Describe it.", GREEDY, images=[[img]])[0]
    assert out.error is None
    req_items = _items_of(llm, "Describe it.", img)
    assert out.token_ids == _hf_greedy(hf, out.prompt_token_ids, req_items, len(out.token_ids))


def _items_of(llm, prompt, img):
    from flashinfra.multimodal.llm_inputs import multimodal_prompt

    return multimodal_prompt(llm, prompt, [img], None)[1]


def test_encoder_cache_and_prefix_cache_give_cold_outputs(ckpt):
    path, _ = ckpt
    img = random_image(120, 90, seed=1)
    prompt = "Q: what is shown? A:"
    cold = _llm(path, prefix_cache_slots=0).generate(prompt, GREEDY, images=[[img]])[0].token_ids

    llm = _llm(path)
    first = llm.generate(prompt, GREEDY, images=[[img]])[0].token_ids
    encoded = llm.engine.runner.embedder.num_encoded
    assert _prefix_hits(llm) == 0
    second = llm.generate(prompt, GREEDY, images=[[img]])[0].token_ids
    assert first == cold and second == cold
    assert llm.engine.runner.embedder.num_encoded == encoded == 1  # the same image is encoded once
    assert _prefix_hits(llm) > 0
    stats = llm.engine.stats()
    assert stats.num_encoded_items_total == 1 and stats.num_encoder_cache_hits_total >= 1
    assert stats.num_encoder_cache_misses_total == 1 and stats.encoder_seconds_total > 0
    assert stats.encoder_cache_bytes > 0


def _prefix_hits(llm) -> int:
    return llm.engine.stats().num_prefix_hit_tokens_total


def test_same_size_different_images_share_no_prefix(ckpt):
    path, _ = ckpt
    a, b = random_image(100, 100, seed=3), random_image(100, 100, seed=4)
    prompt = "Compare:"
    llm = _llm(path)
    out_a = llm.generate(prompt, GREEDY, images=[[a]])[0]
    out_b = llm.generate(prompt, GREEDY, images=[[b]])[0]
    assert out_a.prompt_token_ids == out_b.prompt_token_ids  # same placeholders, different pixels
    assert _prefix_hits(llm) == 0
    cold_b = _llm(path, prefix_cache_slots=0).generate(prompt, GREEDY, images=[[b]])[0]
    assert out_b.token_ids == cold_b.token_ids
    assert llm.engine.runner.embedder.num_encoded == 2


def test_chunked_prefill_splits_an_image(ckpt):
    path, _ = ckpt
    img = random_image(150, 150, seed=5)  # 25 placeholder tokens, chunks of 8 tokens
    whole = _llm(path, prefix_cache_slots=0).generate("x", GREEDY, images=[[img]])[0]
    chunked = _llm(path, prefix_cache_slots=0, max_num_batched_tokens=8).generate("x", GREEDY, images=[[img]])[0]
    assert whole.token_ids == chunked.token_ids


def test_batch_of_images_in_one_step(ckpt):
    path, _ = ckpt
    imgs = [random_image(60 + 20 * i, 90, seed=10 + i) for i in range(3)]
    llm = _llm(path, prefix_cache_slots=0)
    batched = llm.generate(["a", "b", "c"], GREEDY, images=[[im] for im in imgs])
    alone = [_llm(path, prefix_cache_slots=0).generate(p, GREEDY, images=[[im]])[0]
             for p, im in zip("abc", imgs)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]


def test_text_only_engine_refuses_images_and_loads_no_tower(ckpt):
    path, _ = ckpt
    llm = LLM(path, num_blocks=64)
    assert llm.engine.model.vision is None and llm.engine.runner.embedder is None
    with pytest.raises(ValueError, match="enable_vision"):
        llm.generate("hi", GREEDY, images=[[random_image(30, 30, seed=0)]])


def test_video_generation_matches_transformers(ckpt, tmp_path):
    """A video file (decoded with PyAV, frames sampled at 2 fps) through the engine, against transformers fed
    the same patches and the same prompt."""
    import av
    import numpy as np

    from flashinfra.multimodal.llm_inputs import multimodal_prompt

    path, hf = ckpt
    video = tmp_path / "clip.mp4"
    with av.open(str(video), "w") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        for i in range(10):
            frame = np.random.default_rng(i).integers(0, 256, (64, 96, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    llm = _llm(path, prefix_cache_slots=0)
    out = llm.generate("What happens?", GREEDY, videos=[[video]])[0]
    assert out.error is None
    ids, items = multimodal_prompt(llm, "What happens?", None, [video])
    assert ids == out.prompt_token_ids and items[0].kind == "video" and items[0].grid[0] >= 2
    assert out.token_ids == _hf_greedy(hf, ids, items, len(out.token_ids))


def test_engine_refuses_malformed_items(ckpt):
    """Items that do not fit their prompt or canvas are refused at admission (never reach a step)."""
    import msgspec
    import time

    from flashinfra.engine.sched.messages import EngineRequest
    from flashinfra.multimodal.llm_inputs import multimodal_prompt

    path, _ = ckpt
    llm = _llm(path)
    ids, (item,) = multimodal_prompt(llm, "x", [random_image(60, 60, seed=0)], None)
    bad = [
        (ids, msgspec.structs.replace(item, offset=item.offset + 1)),  # span misses a pad token
        (ids, msgspec.structs.replace(item, shape=(1, 3, 28, 28))),  # canvas does not fit the grid
        (ids, msgspec.structs.replace(item, pixels=item.pixels[:-1])),  # truncated pixels
        (ids[: item.offset + 3], item),  # span leaves the prompt
    ]
    for prompt, it in bad:
        with pytest.raises(ValueError, match="multimodal item|placeholder"):
            llm.engine.add_request(EngineRequest("bad", prompt, GREEDY, time.time(), [it]))
    with pytest.raises(ValueError, match="placeholder"):  # pads without an image
        llm.engine.add_request(EngineRequest("bad", ids, GREEDY, time.time(), []))
    assert not llm.engine.has_work()


def test_encoder_runs_split_by_patch_budget(ckpt, monkeypatch):
    """Images over the per-run patch budget go through the tower in several runs, with the same rows."""
    import flashinfra.multimodal.encoder as enc
    from flashinfra.multimodal.llm_inputs import multimodal_prompt

    path, _ = ckpt
    llm = _llm(path)
    items = [multimodal_prompt(llm, "x", [random_image(60 + 30 * i, 80, seed=i)], None)[1][0] for i in range(3)]
    tower = llm.engine.model.vision
    whole = enc.encode_items(tower, items, torch.device("cpu"))
    runs = []
    monkeypatch.setattr(enc, "ENCODER_BATCH_PATCHES", max(it.grid[1] * it.grid[2] for it in items))
    real = tower.forward
    monkeypatch.setattr(tower, "forward", lambda p, g: runs.append(len(g)) or real(p, g))
    split = enc.encode_items(tower, items, torch.device("cpu"))
    assert len(runs) > 1 and sum(runs) == 3
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert enc.encoder_reserve_bytes(llm.engine.model, 100) > 100


def test_image_marks_in_the_prompt(ckpt):
    """A bare <|image|> and the template's full form give one prompt; marks place the images in order."""
    from flashinfra.multimodal.llm_inputs import multimodal_prompt

    path, _ = ckpt
    llm = _llm(path)
    a, b = random_image(40, 40, seed=1), random_image(70, 40, seed=2)
    bare = multimodal_prompt(llm, "A <|image|> B <|image|>", [a, b], None)
    full = multimodal_prompt(llm, "A <|begin_of_image|><|image|><|end_of_image|> B "
                                  "<|begin_of_image|><|image|><|end_of_image|>", [a, b], None)
    assert bare[0] == full[0] and [it.content_hash for it in bare[1]] == [it.content_hash for it in full[1]]
    ids, items = bare
    assert [ids[it.offset - 1] for it in items] == [4079, 4079]  # <|begin_of_image|> before each span
    assert items[0].num_embeds != items[1].num_embeds
    with pytest.raises(ValueError, match="marks"):
        multimodal_prompt(llm, "only <|image|>", [a, b], None)
