"""The engine side of images and video: encode what a step needs, cache it by content, fill the embeddings.

``MultiModalEmbedder.embed`` takes one step's packed ``input_ids`` and its scheduled requests; for every
image or video whose placeholder span overlaps the step's tokens it makes sure the item's encoder output
is in the ``EncoderCache`` (all missing items of the step go through the vision tower together, in runs of at most
``ENCODER_BATCH_PATCHES`` patches),
then returns the step's input embeddings with the placeholder (image pad) rows replaced, in order, by the
item's rows: transformers' ``masked_scatter``, sliced to the step's range so that a chunked prefill may
split an item anywhere. Text-only steps return ``None`` and cost nothing.

The text model then runs on those embeddings (``Glm5NextModel.forward(..., inputs_embeds=)``).
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict

import numpy as np
import torch
import torch.nn.functional as F

from flashinfra.engine.sched.messages import MultiModalItem
from flashinfra.model.vision import VisionTower
from flashinfra.multimodal.pixels import patchify

ENCODER_BATCH_PATCHES = 1 << 16  # most patches one tower run takes (bounds its activation memory)


def encoder_reserve_bytes(model, cache_bytes: int, remote: bool = False) -> int:
    """Device memory to leave free for the encoder when the KV cache is sized from what is free: the encoder
    cache and one run's activations (only the cache when an encode engine makes the embeddings, ``remote``;
    0 without either: text only reserves nothing)."""
    if model.vision is None:
        return cache_bytes if remote else 0
    cfg = model.vision.cfg
    per_patch = (8 * cfg.hidden_size + 3 * cfg.intermediate_size) * model.dtype.itemsize
    return cache_bytes + ENCODER_BATCH_PATCHES * per_patch


class EncoderCache:
    """content hash -> encoder rows ``[num_embeds, D]``, least recently used evicted past ``capacity`` bytes
    (the items of the step being built are never evicted by it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> torch.Tensor:
        self._rows.move_to_end(key)
        return self._rows[key]

    def put(self, key: str, rows: torch.Tensor, pinned: set[str]) -> None:
        self._rows[key] = rows
        self.nbytes += rows.numel() * rows.element_size()
        for old in list(self._rows):
            if self.nbytes <= self.capacity:
                break
            if old not in pinned:
                t = self._rows.pop(old)
                self.nbytes -= t.numel() * t.element_size()


def item_patches(item: MultiModalItem, device: torch.device) -> torch.Tensor:
    canvas = np.frombuffer(item.pixels, dtype=np.uint8).reshape(item.shape)
    return patchify(torch.from_numpy(canvas.copy()).to(device), item.kind)


def encode_items(tower: VisionTower, items: list[MultiModalItem], device: torch.device) -> list[torch.Tensor]:
    """``items`` through the tower, as few runs as ``ENCODER_BATCH_PATCHES`` allows; one ``[num_embeds, D]``
    tensor each, in order."""
    out: list[torch.Tensor] = []
    group: list[MultiModalItem] = []
    size = 0
    for it in items + [None]:
        n = 0 if it is None else it.grid[0] * it.grid[1] * it.grid[2]
        if group and (it is None or size + n > ENCODER_BATCH_PATCHES):
            patches = torch.cat([item_patches(g, device) for g in group])
            out += tower(patches, [g.grid for g in group])  # a video's t frames each attend within themselves
            group, size = [], 0
        if it is not None:
            group.append(it)
            size += n
    return out


def pad_positions(prompt: list[int], item: MultiModalItem, pad_id: int) -> list[int]:
    return [p for p in range(item.offset, item.end) if prompt[p] == pad_id]


def validate_items(prompt: list[int], items: list[MultiModalItem], pad_id: int, merge_unit: int,
                   patch: int = 14, temporal: int = 2) -> None:
    """Raise ``ValueError`` if the items' spans overlap, leave the prompt, or hold the wrong pad count, or a
    canvas does not fit its grid (checked here so that a bad item fails its request, not the engine step)."""
    end = 0
    for i, it in enumerate(sorted(items, key=lambda it: it.offset)):
        t, h, w = it.grid
        frames = 1 if it.kind == "image" else t * temporal
        if (it.kind not in ("image", "video") or min(t, h, w) < 1 or (it.kind == "image" and t != 1)
                or h % 2 or w % 2 or tuple(it.shape) != (frames, 3, h * patch, w * patch)):
            raise ValueError(f"multimodal item {i}: a {it.kind} canvas of shape {it.shape} does not fit grid {it.grid}")
        if it.offset < end or it.end > len(prompt) or it.length < 1:
            raise ValueError(f"multimodal item {i}: span [{it.offset}, {it.end}) overlaps another or leaves the prompt")
        if it.num_embeds * merge_unit != t * h * w or len(pad_positions(prompt, it, pad_id)) != it.num_embeds:
            raise ValueError(f"multimodal item {i}: {it.num_embeds} embeddings for grid {it.grid} do not match "
                             f"its placeholder tokens")
        if len(it.pixels) != int(np.prod(it.shape)):
            raise ValueError(f"multimodal item {i}: {len(it.pixels)} bytes for canvas shape {it.shape}")
        end = it.end
    pad_total = sum(1 for t in prompt if t == pad_id)
    if pad_total != sum(it.num_embeds for it in items):
        raise ValueError(f"the prompt has {pad_total} image placeholder tokens but its images/videos fill "
                         f"{sum(it.num_embeds for it in items)}")


class MultiModalEmbedder:
    """``tower`` None: the embeddings come from an encode engine (``disagg.remote_encode`` puts them in the
    cache before a request is scheduled), and the embedder only reads the cache."""

    def __init__(self, tower: VisionTower | None, embed_tokens: torch.Tensor, pad_id: int, cache_bytes: int) -> None:
        self.tower = tower
        self.embed_tokens = embed_tokens
        self.pad_id = pad_id
        self.cache = EncoderCache(cache_bytes)
        self.num_encoded = 0  # items run through the tower (tests and stats)
        self.encode_seconds = 0.0  # wall time of the tower runs, up to their outputs being ready

    def embed(self, input_ids: torch.Tensor, scheduled) -> torch.Tensor | None:
        if not any(sr.mm_items for sr in scheduled):
            return None
        needed = {it.content_hash: it for sr in scheduled for it in sr.mm_items}
        missing = [it for key, it in needed.items() if key not in self.cache]
        self.cache.hits += len(needed) - len(missing)
        self.cache.misses += len(missing)
        if missing and self.tower is None:
            raise RuntimeError(f"{len(missing)} images/videos have no embeddings in the encoder cache, and this "
                               f"engine has no vision tower to make them")
        if missing:
            start = time.perf_counter()
            rows = encode_items(self.tower, missing, input_ids.device)
            if input_ids.device.type == "cuda":
                torch.cuda.synchronize(input_ids.device)  # the step needs the rows next; only encoding steps wait
            self.encode_seconds += time.perf_counter() - start
            self.num_encoded += len(missing)
            for it, r in zip(missing, rows):  # a copy each, so evicting one frees its memory
                self.cache.put(it.content_hash, r.clone(), set(needed))
        x = F.embedding(input_ids, self.embed_tokens)
        dst, src = [], []
        base = 0
        for sr in scheduled:
            lo, hi = sr.context_len, sr.context_len + sr.num_new_tokens
            for it in sr.mm_items:
                pads = pad_positions(sr.prompt_token_ids, it, self.pad_id)
                j0, j1 = bisect.bisect_left(pads, lo), bisect.bisect_left(pads, hi)
                if j1 > j0:
                    dst.extend(base + p - lo for p in pads[j0:j1])
                    src.append(self.cache.get(it.content_hash)[j0:j1])
            base += sr.num_new_tokens
        if dst:
            x[torch.tensor(dst, device=x.device)] = torch.cat(src).to(x.dtype)
        return x


def make_embedder(model, cache_bytes: int, remote: bool = False) -> MultiModalEmbedder | None:
    """The embedder of a ``LoadedModel`` whose vision tower is loaded, or whose embeddings an encode engine
    makes (``remote``), else None (text only, nothing held)."""
    if model.vision is None and not remote:
        return None
    return MultiModalEmbedder(model.vision, model.model.embed_tokens, model.config.image_token_id, cache_bytes)


def validate_request(model, prompt: list[int], items: list[MultiModalItem], embeds: bool) -> None:
    """A request's images/videos against the model (``embeds``: whether the engine can embed them, with its
    tower or an encode engine): ``ValueError`` naming what is wrong."""
    if items and not embeds:
        raise ValueError("this engine was started without vision (enable_vision=False): images and video are refused")
    if not embeds:
        return
    cfg = model.config.vision
    validate_items(prompt, items, model.config.image_token_id, cfg.spatial_merge_size ** 2, cfg.patch_size,
                   cfg.temporal_patch_size)
