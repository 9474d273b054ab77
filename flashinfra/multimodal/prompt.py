"""Prompt token ids with image and video placeholders, as transformers' ``Glm5NextProcessor`` expands them.

The chat template writes ``<|begin_of_image|><|image|><|end_of_image|>`` for an image and
``<|begin_of_video|><|video|><|end_of_video|>`` for a video. The processor replaces ``<|image|>`` by one
image pad token per merged patch, and ``<|video|>`` by, per temporal patch,
``<|begin_of_image|>`` + pads + ``<|end_of_image|>`` + ``"{t:.1f} seconds"``. GLM uses the image pad token
in videos too; the language model tells them apart only by the video start/end span. The language model
has no rotary positions (NoPE MLA, KDA), so placeholders take ordinary consecutive positions.
Pure Python; no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flashinfra.engine.sched.messages import MultiModalItem
from flashinfra.multimodal.processor import Canvas

IMAGE_MARK, VIDEO_MARK = "<|image|>", "<|video|>"
IMAGE_PART = "<|begin_of_image|>" + IMAGE_MARK + "<|end_of_image|>"
VIDEO_PART = "<|begin_of_video|>" + VIDEO_MARK + "<|end_of_video|>"


@dataclass(frozen=True)
class TokenIds:
    image_pad: int
    image_start: int
    image_end: int

    @staticmethod
    def from_config(cfg) -> "TokenIds":
        """From a ``flashinfra.config.ModelConfig``."""
        return TokenIds(cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id)


def placeholder_tokens(canvas: Canvas, ids: TokenIds, encode: Callable[[str], list[int]]) -> list[int]:
    """What replaces the ``<|image|>`` / ``<|video|>`` mark of one item."""
    if canvas.kind == "image":
        return [ids.image_pad] * canvas.num_embeds
    per_frame = canvas.num_embeds // canvas.grid[0]
    out: list[int] = []
    for stamp in canvas.timestamps:
        out += [ids.image_start] + [ids.image_pad] * per_frame + [ids.image_end] + encode(f"{stamp:.1f} seconds")
    return out


def make_item(canvas: Canvas, offset: int, length: int) -> MultiModalItem:
    return MultiModalItem(kind=canvas.kind, content_hash=canvas.content_hash, offset=offset, length=length,
                          grid=canvas.grid, shape=tuple(canvas.pixels.shape), pixels=canvas.pixels.tobytes(),
                          num_embeds=canvas.num_embeds)


def split_marks(text: str) -> list[str]:
    """``text`` cut at every image/video mark; the marks are kept as their own pieces."""
    pieces, i = [], 0
    while True:
        hits = [(text.find(m, i), m) for m in (IMAGE_MARK, VIDEO_MARK)]
        hits = [(j, m) for j, m in hits if j >= 0]
        if not hits:
            pieces.append(text[i:])
            return [p for p in pieces if p]
        j, m = min(hits)
        pieces += [text[i:j], m]
        i = j + len(m)


def build_prompt(text: str, canvases: list[Canvas], ids: TokenIds,
                 encode: Callable[[str], list[int]]) -> tuple[list[int], list[MultiModalItem]]:
    """Rendered prompt text with one mark per canvas (in order) -> token ids and the items' spans.

    ``encode`` tokenizes text without adding special tokens (the text pieces are tokenized apart; the
    marks are special tokens, so a tokenizer splits there anyway)."""
    pieces = split_marks(text)
    marks = [p for p in pieces if p in (IMAGE_MARK, VIDEO_MARK)]
    if len(marks) != len(canvases):
        raise ValueError(f"the prompt has {len(marks)} image/video marks for {len(canvases)} images/videos")
    prompt: list[int] = []
    items: list[MultiModalItem] = []
    k = 0
    for piece in pieces:
        if piece in (IMAGE_MARK, VIDEO_MARK):
            canvas = canvases[k]
            want = IMAGE_MARK if canvas.kind == "image" else VIDEO_MARK
            if piece != want:
                raise ValueError(f"mark {k} is {piece} but item {k} is a {canvas.kind}")
            toks = placeholder_tokens(canvas, ids, encode)
            items.append(make_item(canvas, len(prompt), len(toks)))
            prompt += toks
            k += 1
        else:
            prompt += encode(piece)
    return prompt, items
