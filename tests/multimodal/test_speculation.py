"""Speculative decoding with images and videos (the built-in model's MTP layer and vision tower): one batch with an
image request, a video request, a request with both and a text request gives every greedy token of the engine
without drafts, and the drafts ran on the media requests' positions too."""

from __future__ import annotations

from flashinfra import LLM, SamplingParams
from tests.multimodal.mm_reference import random_image

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_images_and_videos_with_drafts_equal_without():
    video = [random_image(56, 56, seed=s) for s in range(4)]
    prompts = ["Describe <|image|> please.", "What happens in <|video|>?", "Compare <|image|> and <|video|>.",
               "The capital of France is"]
    images = [[random_image(80, 110, seed=0)], None, [random_image(64, 64, seed=3)], None]
    videos = [None, [video], [video], None]
    outputs = {}
    for k in (0, 3):
        llm = LLM(enable_vision=True, speculative_tokens=k, max_num_seqs=4, num_blocks=256)
        try:
            outputs[k] = llm.generate(prompts, GREEDY, images=images, videos=videos)
            if k:
                assert llm.engine.runner.speculator.num_drafted > 0
        finally:
            llm.engine.close()
    for without, with_drafts in zip(outputs[0], outputs[3]):
        assert without.error is None and with_drafts.error is None
        assert len(without.token_ids) == 12 and with_drafts.token_ids == without.token_ids
