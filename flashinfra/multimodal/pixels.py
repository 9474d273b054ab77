"""Canvas -> normalised patches, on the engine's device: transformers' rescale, normalise and patchify.

An image's canvas is one uint8 frame ``[1, 3, H, W]`` (the processor broadcasts it over the temporal patch);
a video's is ``[F, 3, H, W]`` with ``F`` a multiple of the temporal patch. Images are rescaled in float64
and normalised in float32 (the numpy path of ``Glm5NextImageProcessorPil``, bit for bit); videos use the
torch path of ``Glm5NextVideoProcessor`` (mean and std folded with the rescale factor, float32).
Rows come out in merge-block order, columns as ``(C, Tp, P, P)``: what the vision tower reads.
"""

from __future__ import annotations

import torch

from flashinfra.multimodal.processor import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalise(canvas: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 [F, 3, H, W] -> float32 [F, 3, H, W]."""
    mean = torch.tensor(CLIP_MEAN, dtype=torch.float32, device=canvas.device)[:, None, None]
    std = torch.tensor(CLIP_STD, dtype=torch.float32, device=canvas.device)[:, None, None]
    if kind == "image":
        x = (canvas.to(torch.float64) * (1 / 255)).to(torch.float32)
        return (x - mean) / std
    return (canvas.to(torch.float32) - mean * 255.0) / (std * 255.0)


def patchify(canvas: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 canvas [F, 3, H, W] -> float32 patches [t * h * w, 3 * Tp * P * P]."""
    x = normalise(canvas, kind)
    if kind == "image":
        x = x.expand(TEMPORAL_PATCH_SIZE, -1, -1, -1)
    F_, C, H, W = x.shape
    P, m, tp = PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE
    gt, gh, gw = F_ // tp, H // P, W // P
    x = x.reshape(gt, tp, C, gh // m, m, P, gw // m, m, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tp, P, P)
    return x.reshape(gt * gh * gw, C * tp * P * P)
