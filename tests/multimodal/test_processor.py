"""Preprocessing against transformers 5.24: image patches bit for bit (PIL processor), video frame sampling,
and the canvas and token counts."""

from __future__ import annotations

import ast
import inspect
import math

import numpy as np
import pytest
import torch

from flashinfra.multimodal.pixels import patchify
from flashinfra.multimodal.processor import image_canvas, sample_frame_indices, smart_resize, video_canvas


def _image(h, w, mode, seed):
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 4), dtype=np.uint8)
    return Image.fromarray(arr, "RGBA").convert(mode)


@pytest.mark.parametrize("h,w,mode", [(37, 91, "RGB"), (300, 200, "RGBA"), (1000, 1500, "L"), (5, 5, "RGB"),
                                      (2000, 30, "P"), (448, 448, "RGB")])
def test_image_patches_match_transformers(h, w, mode):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    img = _image(h, w, mode, seed=h + w)
    ref = Glm5NextImageProcessorPil()(images=[img], return_tensors="np")
    canvas = image_canvas(img)
    assert [list(canvas.grid)] == ref["image_grid_thw"].tolist()
    ours = patchify(torch.from_numpy(canvas.pixels), "image").numpy()
    np.testing.assert_array_equal(ours, ref["pixel_values"])


def _sample_frames_from_source():
    import transformers.models.glm5_next as pkg

    path = inspect.getfile(pkg).replace("__init__.py", "video_processing_glm5_next.py")
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Glm5NextVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    ns = {"np": np, "math": math, "VideoMetadata": object, "__annotations__": {}}
    exec(compile(ast.Module([fn], []), path, "exec"), ns)
    return ns["sample_frames"]


@pytest.mark.parametrize("total,fps", [(1, 30.0), (7, 2.0), (100, 30.0), (301, 29.97), (50, 1.0), (12, 24.0)])
def test_frame_sampling_matches_transformers(total, fps):
    from transformers.video_utils import VideoMetadata

    sample = _sample_frames_from_source()

    class Self:
        max_duration, fps, max_frames = 0, 2, 2048

    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    ref = sample(Self(), meta).tolist()
    assert sample_frame_indices(total, fps, duration=total / fps) == ref
    assert len(ref) % 2 == 0


def test_token_budget_and_alignment():
    for h, w in [(10, 10), (4000, 3000), (28, 2800)]:
        th, tw = smart_resize(2, h, w, 2, 28, 16, 8000)
        assert th % 28 == 0 and tw % 28 == 0 and 16 <= th * tw // 28**2 <= 8000
    canvas = video_canvas([_image(60, 90, "RGB", seed=i) for i in range(3)], fps=1.0)
    assert canvas.pixels.shape[0] == 4 and canvas.grid[0] == 2
    np.testing.assert_array_equal(canvas.pixels[3], canvas.pixels[2])  # odd frame count: last frame repeated


@pytest.mark.parametrize("h,w,frames", [(60, 90, 4), (300, 200, 2), (20, 30, 6)])
def test_video_patches_match_transformers(h, w, frames):
    """Frames resized as the torchvision-backed video processor resizes them (it needs torchvision, which
    flashinfra does not: skipped where it is absent)."""
    pytest.importorskip("torchvision")
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    images = [_image(h, w, "RGB", seed=h + i) for i in range(frames)]
    ref = Glm5NextVideoProcessor()(videos=[np.stack([np.asarray(im) for im in images])], do_sample_frames=False,
                                   return_tensors="pt")
    canvas = video_canvas(images, fps=2.0)
    assert [list(canvas.grid)] == ref["video_grid_thw"].tolist()
    ours = patchify(torch.from_numpy(canvas.pixels), "video")
    torch.testing.assert_close(ours, ref["pixel_values_videos"].to(ours.dtype), rtol=0, atol=1e-6)


def test_video_frames_resize_as_torch_uint8_bicubic():
    """The video path's resize is torch's antialiased uint8 bicubic (torchvision's CPU path), not PIL's."""
    from torch.nn.functional import interpolate

    images = [_image(700, 450, "RGB", seed=i) for i in range(2)]
    canvas = video_canvas(images, fps=2.0, max_tokens=256)  # a downscale
    th, tw = canvas.pixels.shape[2:]
    scale = min(th / 700, tw / 450, 1.0)
    ch, cw = math.floor(700 * scale), math.floor(450 * scale)
    assert ch < 700
    x = torch.from_numpy(np.stack([np.asarray(im) for im in images]).transpose(0, 3, 1, 2).copy())
    ref = interpolate(x, size=[ch, cw], mode="bicubic", align_corners=False, antialias=True).numpy()
    np.testing.assert_array_equal(canvas.pixels[:, :, :ch, :cw], ref)
    assert not canvas.pixels[:, :, ch:, :].any() and not canvas.pixels[:, :, :, cw:].any()
