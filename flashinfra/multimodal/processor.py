"""Preprocessing as transformers 5.24 does it for ``glm5_next``, up to the resized, padded uint8 canvas.

``image_canvas`` reimplements ``Glm5NextImageProcessorPil`` (RGB conversion with alpha composited on white,
``smart_resize`` to a canvas aligned to ``patch * merge`` within the token budget, PIL bicubic resize of the
content, zero padding on the bottom and right). ``video_canvas`` does the same per frame with the video
processor's budget and pads the frame count to a multiple of ``temporal_patch_size`` by repeating the last
frame; ``sample_frame_indices`` is ``Glm5NextVideoProcessor.sample_frames``. Rescale, normalise and
patchify run on the engine side (``flashinfra.multimodal.pixels``), so what travels from the server is the
uint8 canvas: a quarter of the float32 bytes, and no copy per temporal patch.

Video frames are resized as transformers' video processor resizes them, without torchvision: its resize
of a uint8 tensor on the CPU is torch's antialiased bicubic ``interpolate`` on uint8, called here
directly (PIL's bicubic, used for images as the PIL image processor does, differs from it on a few
pixels).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
IMAGE_MIN_TOKENS, IMAGE_MAX_TOKENS = 16, 8000
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS = 16, 240000
VIDEO_FPS, VIDEO_MAX_FRAMES = 2, 2048


@dataclass(frozen=True)
class Canvas:
    """One image or video after resizing: uint8 ``[frames, 3, H, W]`` and its patch grid ``(t, h, w)``."""

    kind: str  # "image" | "video"
    pixels: np.ndarray
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...] = ()  # video: seconds of each temporal patch (the first of its frames)

    @property
    def num_embeds(self) -> int:
        t, h, w = self.grid
        return t * h * w // MERGE_SIZE**2

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256(f"{self.kind}:{self.grid}:{self.pixels.shape}:".encode())
        h.update(np.ascontiguousarray(self.pixels).tobytes())
        return h.hexdigest()


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int = 2, factor: int = 28,
                 min_pixels: int = 16, max_pixels: int = 8000) -> tuple[int, int]:
    """transformers' ``glm5_next`` ``smart_resize``: an aligned canvas within the spatiotemporal budget."""
    pixels_per_token = temporal_factor * factor**2
    min_pixels *= pixels_per_token
    max_pixels *= pixels_per_token

    def align(value):
        return math.ceil(value / factor) * factor

    def fit_within_budget(aligned_frames):
        if max_pixels < aligned_frames * factor**2:
            raise ValueError(f"max_pixels={max_pixels} is too small for one aligned patch")
        low, high = 1, height
        best = (factor, factor)
        while low <= high:
            content_height = (low + high) // 2
            content_width = max(1, math.floor(width * content_height / height))
            cand = (align(content_height), align(content_width))
            if aligned_frames * cand[0] * cand[1] <= max_pixels:
                best = cand
                low = content_height + 1
            else:
                high = content_height - 1
        return best

    aligned_frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    ah, aw = align(height), align(width)
    if aligned_frames * ah * aw < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        ah, aw = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if aligned_frames * ah * aw > max_pixels:
        ah, aw = fit_within_budget(aligned_frames)
    return ah, aw


def to_rgb(image):
    """transformers' ``convert_to_rgb``: transparent images are composited on white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def _resize_pil(frames: list, height: int, width: int) -> np.ndarray:
    """PIL bicubic, frame by frame (the PIL image processor's resize): uint8 [F, 3, height, width]."""
    from PIL import Image

    return np.stack([np.asarray(f.resize((width, height), resample=Image.BICUBIC), dtype=np.uint8).transpose(2, 0, 1)
                     for f in frames])


def _resize_torch(frames: list, height: int, width: int) -> np.ndarray:
    """torchvision's CPU resize of uint8 frames (antialiased bicubic on uint8), as the video processor calls it."""
    import torch
    from torch.nn.functional import interpolate

    x = torch.from_numpy(np.stack([np.asarray(f, dtype=np.uint8) for f in frames]).transpose(0, 3, 1, 2).copy())
    return interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True).numpy()


def _fit(frames: list, num_frames: int, min_tokens: int, max_tokens: int, resize=_resize_pil) -> np.ndarray:
    """Resize and zero-pad RGB frames of one size onto the aligned canvas: uint8 [F, 3, H, W]."""
    width, height = frames[0].size
    factor = PATCH_SIZE * MERGE_SIZE
    th, tw = smart_resize(num_frames, height, width, TEMPORAL_PATCH_SIZE, factor, min_tokens, max_tokens)
    scale = min(th / height, tw / width)
    if num_frames * height * width >= TEMPORAL_PATCH_SIZE * factor**2 * min_tokens:
        scale = min(1.0, scale)
    ch, cw = max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))
    out = np.zeros((len(frames), 3, th, tw), dtype=np.uint8)
    if (ch, cw) != (height, width):
        out[:, :, :ch, :cw] = resize(frames, ch, cw)
    else:
        out[:, :, :ch, :cw] = np.stack([np.asarray(f, dtype=np.uint8).transpose(2, 0, 1) for f in frames])
    return out


def image_canvas(image, min_tokens: int = IMAGE_MIN_TOKENS, max_tokens: int = IMAGE_MAX_TOKENS) -> Canvas:
    """A PIL image -> its canvas (one frame; the encoder repeats it over the temporal patch)."""
    pixels = _fit([to_rgb(image)], TEMPORAL_PATCH_SIZE, min_tokens, max_tokens)
    return Canvas("image", pixels, (1, pixels.shape[2] // PATCH_SIZE, pixels.shape[3] // PATCH_SIZE))


def sample_frame_indices(total_frames: int, fps: float, target_fps: float = VIDEO_FPS,
                         max_frames: int = VIDEO_MAX_FRAMES, duration: float | None = None) -> list[int]:
    """``Glm5NextVideoProcessor.sample_frames``: about ``target_fps`` frames per second, an even count."""
    max_frame_idx = total_frames - 1
    duration = duration or round(max_frame_idx / fps) + 1
    max_seconds = int(duration)
    extract_t = min(int(duration * target_fps), max_frames)
    timestamps = [i / fps for i in range(total_frames)]
    if total_frames < extract_t:
        indices = np.linspace(0, total_frames - 1, extract_t, dtype=int).tolist()
    else:
        indices, current = [], 0
        for i in range(total_frames):
            if timestamps[i] >= current:
                current += 1 / target_fps
                indices.append(i)
                if current >= max_seconds:
                    break
    if len(indices) < extract_t:
        start, end = (0, max(total_frames - 1, 0)) if not indices else (indices[0], indices[-1])
        indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(indices) > extract_t:
        indices = np.linspace(0, total_frames - 1, extract_t, dtype=int).tolist()
    uniq = list(dict.fromkeys(indices))
    if len(uniq) & 1:
        uniq.append(uniq[-1])
    return uniq


def video_canvas(frames: list, fps: float | None, frame_indices: list[int] | None = None,
                 min_tokens: int = VIDEO_MIN_TOKENS, max_tokens: int = VIDEO_MAX_TOKENS) -> Canvas:
    """Sampled frames (PIL, one size) -> the video canvas, its grid and one timestamp per temporal patch.

    ``fps`` and ``frame_indices`` give the timestamps (transformers falls back to 24 fps without them)."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    frames = [to_rgb(f) for f in frames]
    if len({f.size for f in frames}) != 1:
        raise ValueError("all frames of a video must have one size")
    pixels = _fit(frames, len(frames), min_tokens, max_tokens, _resize_torch)
    if pad := -len(frames) % TEMPORAL_PATCH_SIZE:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
    t = pixels.shape[0] // TEMPORAL_PATCH_SIZE
    fps = fps or 24
    indices = frame_indices if frame_indices is not None else list(range(len(frames)))
    stamps = [i / fps for i in indices][::TEMPORAL_PATCH_SIZE][:t]
    while len(stamps) < t:
        stamps.append(stamps[-1] if stamps else 0)
    return Canvas("video", pixels, (t, pixels.shape[2] // PATCH_SIZE, pixels.shape[3] // PATCH_SIZE), tuple(stamps))
