"""Images and videos as callers hand them over -> canvases, with limits; shared by ``LLM``, the CLI and the server.

An image is a ``PIL.Image``, a path or encoded bytes (PNG, JPEG, WebP, GIF...); a video is a path or bytes
of a container PyAV (``av``) can read, or a list of frames (images) with an optional ``fps``. Decoding
is bounded: ``MediaLimits`` caps encoded bytes, decoded pixels per image or frame, and frames per video,
and every violation is a ``MediaError`` whose message the server puts in a 400.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashinfra.multimodal.processor import Canvas, image_canvas, sample_frame_indices, video_canvas


class MediaError(ValueError):
    """An image or video that cannot be used (undecodable, wrong type, over a limit)."""


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 20 * 2**20  # encoded size of one image or video
    max_pixels: int = 40_000_000  # decoded width * height of one image or frame
    max_frames: int = 256  # sampled frames of one video
    max_items: int = 8  # images + videos in one request


def _bytes_of(src: Any, limits: MediaLimits) -> bytes:
    if isinstance(src, (bytes, bytearray)):
        data = bytes(src)
    elif isinstance(src, (str, Path)):
        path = Path(src)
        if not path.is_file():
            raise MediaError(f"no such file: {path}")
        if path.stat().st_size > limits.max_bytes:
            raise MediaError(f"{path} is {path.stat().st_size} bytes, over the limit of {limits.max_bytes}")
        data = path.read_bytes()
    else:
        raise MediaError(f"cannot read an image or video from a {type(src).__name__}")
    if len(data) > limits.max_bytes:
        raise MediaError(f"{len(data)} bytes, over the limit of {limits.max_bytes}")
    return data


def decode_image(src: Any, limits: MediaLimits = MediaLimits()):
    """A ``PIL.Image`` (fully loaded) from a PIL image, a path or encoded bytes."""
    from PIL import Image

    if isinstance(src, Image.Image):
        image = src
    else:
        data = _bytes_of(src, limits)
        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > limits.max_pixels:
                raise MediaError(f"{image.width}x{image.height} pixels, over the limit of {limits.max_pixels}")
            image.load()
        except MediaError:
            raise
        except Exception as exc:  # PIL raises many types for broken data
            raise MediaError(f"not a readable image ({type(exc).__name__}: {exc})") from None
    if image.width * image.height > limits.max_pixels:
        raise MediaError(f"{image.width}x{image.height} pixels, over the limit of {limits.max_pixels}")
    if image.width < 1 or image.height < 1:
        raise MediaError("an image needs at least one pixel")
    return image


def decode_video(src: Any, limits: MediaLimits = MediaLimits()) -> tuple[list, float | None, list[int]]:
    """Frames sampled as transformers samples them (about 2 per second), the source fps and their indices.

    ``src``: a path or bytes of a video file (read with PyAV), or a list of frames (taken as they are)."""
    if isinstance(src, (list, tuple)):
        if not src:
            raise MediaError("a video needs at least one frame")
        if len(src) > limits.max_frames:
            raise MediaError(f"{len(src)} frames, over the limit of {limits.max_frames}")
        return [decode_image(f, limits) for f in src], None, list(range(len(src)))
    data = _bytes_of(src, limits)
    try:
        import av
    except ImportError:
        raise MediaError("video files need PyAV (pip install av); pass a list of frames instead") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else 24.0
            if stream.codec_context.width * stream.codec_context.height > limits.max_pixels:
                raise MediaError(f"{stream.codec_context.width}x{stream.codec_context.height} pixels per frame, "
                                 f"over the limit of {limits.max_pixels}")
            total = stream.frames  # the container's count, as transformers reads it; 0 when unknown
        if total <= 0:
            with av.open(io.BytesIO(data)) as container:
                total = sum(1 for _ in container.decode(video=0))
        if total <= 0:
            raise MediaError("the video has no frames")
        indices = sample_frame_indices(total, fps, duration=total / fps)
        if len(indices) > limits.max_frames:
            raise MediaError(f"{len(indices)} sampled frames, over the limit of {limits.max_frames}")
        # only the sampled frames are converted and kept: memory is bounded by max_frames, not the video's length
        wanted, frames = set(indices), {}
        with av.open(io.BytesIO(data)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames[i] = frame.to_image()
                if i >= indices[-1]:
                    break
    except MediaError:
        raise
    except Exception as exc:
        raise MediaError(f"not a readable video ({type(exc).__name__}: {exc})") from None
    if not frames:
        raise MediaError("the video has no frames")
    last = frames[max(frames)]  # a container that over-counts its frames: the missing ones repeat the last decoded
    return [frames.get(i, last) for i in indices], fps, indices


def image_input(src: Any, limits: MediaLimits = MediaLimits()) -> Canvas:
    return image_canvas(decode_image(src, limits))


def video_input(src: Any, limits: MediaLimits = MediaLimits(), fps: float | None = None) -> Canvas:
    frames, file_fps, indices = decode_video(src, limits)
    return video_canvas(frames, fps or file_fps, indices)
