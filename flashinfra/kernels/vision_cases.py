"""Check cases of the vision tower's fused kernels (``kernels.qk_norm_rope``, ``kernels.swiglu``) and of the
tower on the kernel path, beside the cases of ``flashinfra.kernels.checks``.

- ``qk_norm_rope``: q/k normalised and rotated, v moved, into poisoned ``[S, H, L, hd]`` outputs, against the
  reference computed in float64 (v bit for bit).
- ``add_rms_norm``: the residual add and the RMSNorm of the sum in one kernel, poisoned outputs, against
  float64 (the sum, in float32, bit for bit against the reference's add).
- ``clamped_swiglu``: gate|up with values beyond the limit, poisoned output, against float64.
- ``vision_tower``: a tiny tower (random weights, float32) on the kernel path against the same tower on the
  reference path, frames of one size (the fused attention prologue) and of mixed sizes.

Registered check ``hotpath.vision``: the three at fixed sizes (bf16 on CUDA, float32 under the interpreter).
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult, compare, poison_
from flashinfra.kernels import norms, swiglu
from flashinfra.kernels.check_cases import _d, _gen, rnd, tol
from flashinfra.kernels.checks import _registered
from flashinfra.kernels.dispatch import kernel_path
from flashinfra.kernels.qk_norm_rope import qk_norm_rope_launch, qk_norm_rope_ref

MODULE = "flashinfra.kernels.vision_cases"


def _sdpa_layout(t: torch.Tensor, L: int) -> torch.Tensor:
    """[N, H, hd] -> [N / L, H, L, hd]."""
    N, H, hd = t.shape
    return t.view(N // L, L, H, hd).transpose(1, 2)


def qk_norm_rope(device: str, S: int, L: int, H: int, hd: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    N = S * L
    qkv = rnd(N, 3, H, hd, device=device, gen=gen, dtype=dtype, scale=3.0)
    qw, kw = (1 + rnd(hd, device=device, gen=gen, dtype=dtype, scale=0.5) for _ in range(2))
    ang = rnd(N, hd // 2, device=device, gen=gen, scale=4.0)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    outs = tuple(poison_(torch.empty(S, H, L, hd, dtype=dtype, device=device)) for _ in range(3))
    qk_norm_rope_launch(qkv, qw, kw, cos, sin, 1e-5, L, outs=outs)
    ref = qk_norm_rope_ref(_d(qkv), _d(qw), _d(kw), _d(cos), _d(sin), 1e-5)
    results = [compare(f"hotpath.vision.qk_norm_rope.{n}", o, _sdpa_layout(r, L), **tol(dtype))
               for n, o, r in zip("qk", outs, ref)]
    results.append(compare("hotpath.vision.qk_norm_rope.v", outs[2], _sdpa_layout(qkv[:, 2], L), atol=0, rtol=0))
    return results


def add_rms_norm(device: str, T: int, D: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    x, r = (rnd(T, D, device=device, gen=gen, dtype=dtype) for _ in range(2))
    w = rnd(D, device=device, gen=gen, dtype=dtype)
    s, y = (poison_(torch.empty_like(x)) for _ in range(2))
    norms.add_rms_norm_launch(x, r, w, 1e-5, out=(s, y))
    ref_s, ref_y = norms.add_rms_norm_ref(_d(x), _d(r), _d(w), 1e-5)
    # float32: bit for bit with the reference's add; bf16 under the interpreter may round the float32 sum otherwise
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else tol(dtype)
    return [compare("hotpath.vision.add_rms_norm.sum", s, x + r, **exact),
            compare("hotpath.vision.add_rms_norm.norm", y, ref_y, **tol(dtype))]


def clamped_swiglu(device: str, T: int, I: int, limit=10.0, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    gu = rnd(T, 2 * I, device=device, gen=gen, dtype=dtype, scale=8.0)  # many values past the limit
    out = poison_(torch.empty(T, I, dtype=dtype, device=device))
    swiglu.clamped_swiglu_launch(gu, limit, out=out)
    return [compare("hotpath.vision.clamped_swiglu", out, swiglu.clamped_swiglu_ref(_d(gu), limit), **tol(dtype))]


def vision_tower(device: str, grids, dtype=torch.float32, seed=0) -> list[CheckResult]:
    from flashinfra.config import VisionConfig
    from flashinfra.model.vision import VisionTower

    cfg = VisionConfig(depth=2, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=48,
                       projection_intermediate_size=80, swiglu_limit=2.0)
    torch.manual_seed(seed)
    with torch.device(device):
        tower = VisionTower(cfg).to(dtype).eval()
    gen = _gen(device, seed)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_(rnd(*p.shape, device=device, gen=gen, dtype=dtype, scale=p.shape[-1] ** -0.5 * 2))
    dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    patches = rnd(sum(t * h * w for t, h, w in grids), dim, device=device, gen=gen, dtype=dtype)
    with kernel_path(False):
        ref = tower(patches, grids)
    with kernel_path(True):
        out = tower(patches, grids)
    name = "hotpath.vision.tower." + "_".join(f"{t}x{h}x{w}" for t, h, w in grids)
    return [compare(name, torch.cat(out), torch.cat(ref), **(tol(dtype) if dtype != torch.float32
                                                             else dict(atol=1e-4, rtol=1e-4)))]


@_registered("hotpath.vision", MODULE)
def _vision(dev, act, seed):
    if dev == "cuda":
        return (qk_norm_rope(dev, 5, 196, 16, 64, dtype=act, seed=seed)
                + add_rms_norm(dev, 63, 1024, dtype=act, seed=seed)
                + clamped_swiglu(dev, 37, 4096, dtype=act, seed=seed))
    return (qk_norm_rope(dev, 3, 7, 2, 8, seed=seed) + add_rms_norm(dev, 7, 100, seed=seed)
            + clamped_swiglu(dev, 5, 40, seed=seed)
            + vision_tower(dev, [(1, 4, 4), (1, 4, 4)], seed=seed))
