"""A text prompt plus images/videos -> prompt token ids and items, for the offline ``LLM`` and the CLI."""

from __future__ import annotations

from typing import Any, Sequence

from flashinfra.multimodal.inputs import MediaLimits, image_input, video_input
from flashinfra.multimodal.prompt import (IMAGE_MARK, IMAGE_PART, VIDEO_MARK, VIDEO_PART, TokenIds, build_prompt,
                                         split_marks)


def multimodal_prompt(llm, prompt: Any, images: Sequence[Any] | None, videos: Sequence[Any] | None,
                      limits: MediaLimits = MediaLimits(max_items=1 << 30)):
    if not isinstance(prompt, str):
        raise ValueError("images and videos need a text prompt (it says where they go)")
    if llm.tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer.json: images need a text prompt")
    if llm.engine.runner.embedder is None:
        raise ValueError("images and videos need LLM(..., enable_vision=True) (the vision tower is not loaded)")
    images, videos = list(images or []), list(videos or [])
    # a bare <|image|> gets its begin/end tokens, as the chat template writes them
    for mark, part in ((IMAGE_MARK, IMAGE_PART), (VIDEO_MARK, VIDEO_PART)):
        prompt = prompt.replace(part, mark).replace(mark, part)
    marks = [p for p in split_marks(prompt) if p in (IMAGE_MARK, VIDEO_MARK)]
    if not marks:
        prompt = IMAGE_PART * len(images) + VIDEO_PART * len(videos) + prompt
        marks = [IMAGE_MARK] * len(images) + [VIDEO_MARK] * len(videos)
    if marks.count(IMAGE_MARK) != len(images) or marks.count(VIDEO_MARK) != len(videos):
        raise ValueError(f"the prompt has {marks.count(IMAGE_MARK)} image and {marks.count(VIDEO_MARK)} video marks "
                         f"for {len(images)} images and {len(videos)} videos")
    it_img, it_vid = iter(images), iter(videos)
    canvases = [image_input(next(it_img), limits) if m == IMAGE_MARK else video_input(next(it_vid), limits)
                for m in marks]
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    return build_prompt(prompt, canvases, TokenIds.from_config(llm.engine.model.config), encode)
