"""The GLM-5.3-Flash vision tower: patch embedding, ViT blocks with axial RoPE, spatial merge, projector.

Exact to transformers' ``Glm5NextVisionModel`` (float32): the parameter names are the release names under
``model.visual.`` so a checkpoint loads by name, strictly (``load_vision_weights`` names every missing,
unexpected or mis-shaped tensor). Input is what ``flashinfra.multimodal.processor`` makes: flattened
patches ``[N, C * Tp * P * P]`` in merge-block order and one ``(t, h, w)`` patch grid per item; output is
one ``[t * h * w / m^2, out_hidden]`` embedding per item (the rows the language model's placeholder tokens
take). Each frame attends within itself (transformers' ``cu_seqlens`` per frame); frames of equal size
run as one batched ``scaled_dot_product_attention`` call.

On the kernel path (``kernels.dispatch.use_triton``) the elementwise work runs fused: the Triton RMSNorm, the
q/k norm + RoPE + attention layout in one kernel (``kernels.qk_norm_rope``, frames of one size), and the clamped
SwiGLU over one gate|up GEMM (``kernels.swiglu``; the concatenated weight is made at load, the checkpoint keeps
the release names). The float32 PyTorch path stays the exactness reference.

What it leaves out: preprocessing (pixels -> patches) and where embeddings go in the prompt.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashinfra.config import VisionConfig
from flashinfra.kernels import norms, swiglu
from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.qk_norm_rope import qk_norm_rope_launch
from flashinfra.model.loader import CheckpointError, TensorSource

PREFIX = "model.visual."
ROPE_CACHE_SIZE = 64  # frame shapes whose rotary tables are kept
_ACTS = {"silu": F.silu, "gelu": F.gelu}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norms.rms_norm(x, self.weight, self.eps)  # the reference is the tower's (and transformers') norm


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, act, limit: float) -> torch.Tensor:
    return act(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class _MLP(nn.Module):
    def __init__(self, dim: int, inner: int, bias: bool, act: str, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inner, bias=bias)
        self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)
        self.act, self.limit = _ACTS[act], limit
        self.fused_act = act == "silu"  # the kernel's activation
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2 * inner, dim], made by fuse()
        self.register_buffer("gate_up_bias", None, persistent=False)

    @torch.no_grad()
    def fuse(self) -> None:
        """One [2 * inner, dim] weight for one gate|up GEMM (after the release-named weights are loaded); the
        gate and up parameters become views of its halves, so no weight is held twice."""
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_proj.weight.data, self.up_proj.weight.data = self.gate_up_weight.chunk(2)
        if self.gate_proj.bias is not None:
            self.gate_up_bias = torch.cat([self.gate_proj.bias, self.up_proj.bias])
            self.gate_proj.bias.data, self.up_proj.bias.data = self.gate_up_bias.chunk(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_act and use_triton(x):
            if self.gate_up_weight is None:
                self.fuse()
            return self.down_proj(swiglu.clamped_swiglu_launch(
                F.linear(x, self.gate_up_weight, self.gate_up_bias), self.limit))
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.act, self.limit))


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = _RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = _RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[int, list[int]]]) -> torch.Tensor:
        N = x.shape[0]
        if len(segments) == 1 and len(segments[0][1]) * segments[0][0] == N and use_triton(x):
            qkv = self.qkv(x).view(N, 3, self.num_heads, self.head_dim)
            q, k, v = qk_norm_rope_launch(qkv, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                          self.q_norm.eps, segments[0][0])  # [S, H, L, hd] each
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
            return self.proj(out.reshape(N, -1))
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, hd] each
        q, k = _rope(self.q_norm(q), cos, sin), _rope(self.k_norm(k), cos, sin)
        if len(segments) == 1 and len(segments[0][1]) * segments[0][0] == N:  # frames of one size: views
            S, L = len(segments[0][1]), segments[0][0]
            qs, ks, vs = (t.view(S, L, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
            return self.proj(out.reshape(N, -1))
        out = torch.empty_like(q)
        for length, starts in segments:  # frames of one length: one batched call
            idx = _segment_index(starts, length, x.device)  # [S, L]
            qs, ks, vs = (t[idx].transpose(1, 2) for t in (q, k, v))  # [S, H, L, hd]
            out[idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(N, -1))


def _segment_index(starts: list[int], length: int, device) -> torch.Tensor:
    return torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd]; cos/sin [N, hd], computed in float32 as transformers does."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(dtype)


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = _Attention(cfg)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size, cfg.attention_bias, cfg.hidden_act, cfg.swiglu_limit)

    def forward(self, x, cos, sin, segments):
        if use_triton(x):  # the residual add written by the norm kernel that reads it
            x, h = norms.add_rms_norm_launch(x, self.attn(self.norm1(x), cos, sin, segments), self.norm2.weight,
                                             self.norm2.eps)
            return x + self.mlp(h)
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a stride == kernel convolution over one patch is a matrix product with the flattened kernel
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _Merger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        dim, inner = cfg.out_hidden_size, cfg.projection_intermediate_size
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim)
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.act, self.limit = _ACTS[cfg.hidden_act], cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.post_projection_norm(self.proj(x)))
        return self.down_proj(_clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.act, self.limit))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = _PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.post_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        m = cfg.spatial_merge_size
        self.downsample = nn.Conv2d(cfg.hidden_size, cfg.out_hidden_size, kernel_size=m, stride=m)
        self.merger = _Merger(cfg)
        head_dim = cfg.hidden_size // cfg.num_heads
        spatial = head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)),
            persistent=False,
        )
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # frame (h, w) -> cos, sin

    @property
    def merge_unit(self) -> int:
        return self.cfg.spatial_merge_size ** 2

    def _frame_rotary(self, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [h * w, hd] of one frame's patches in merge-block order (axial: rows | columns)."""
        key = (h, w, str(device))
        if key not in self._rope_cache:
            m = self.cfg.spatial_merge_size
            hp, wp = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            shape = (h // m, m, w // m, m)
            hp, wp = hp.reshape(shape).transpose(1, 2).flatten(), wp.reshape(shape).transpose(1, 2).flatten()
            pos = torch.stack([hp, wp], dim=-1)
            freqs = pos[..., None].float() * self.inv_freq.to(device)  # [h*w, 2, hd/4]
            freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
            freqs = torch.cat([freqs, freqs], dim=-1)  # [h*w, hd]
            if len(self._rope_cache) >= ROPE_CACHE_SIZE:
                self._rope_cache.clear()
            self._rope_cache[key] = (freqs.cos(), freqs.sin())
        return self._rope_cache[key]

    def _rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self._frame_rotary(h, w, device) for t, h, w in grids for _ in range(t)]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    @staticmethod
    def _segments(grids) -> list[tuple[int, list[int]]]:
        by_len: dict[int, list[int]] = {}
        start = 0
        for t, h, w in grids:
            for _ in range(t):
                by_len.setdefault(h * w, []).append(start)
                start += h * w
        return sorted(by_len.items())

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """patches [sum t*h*w, C*Tp*P*P] -> one [t*h*w / m^2, out_hidden] tensor per grid."""
        x = self.patch_embed(patches)
        cos, sin = self._rotary(grids, x.device)
        segments = self._segments(grids)
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        x = self.post_layernorm(x)
        w = self.downsample.weight  # [O, D, m, m]; the m x m block's patches are consecutive rows
        m = self.cfg.spatial_merge_size
        x = x.view(-1, m * m, x.shape[-1]).transpose(1, 2).reshape(-1, w[0].numel())
        x = self.merger(F.linear(x, w.reshape(w.shape[0], -1), self.downsample.bias))
        return list(x.split([t * h * w // self.merge_unit for t, h, w in grids]))


def load_vision_weights(tower: VisionTower, source: TensorSource) -> int:
    """Copy ``model.visual.*`` from ``source`` into ``tower``; every mismatch is a ``CheckpointError``."""
    params = dict(tower.named_parameters())
    names = {n[len(PREFIX):] for n in source.names() if n.startswith(PREFIX)}
    missing = sorted(PREFIX + n for n in params.keys() - names)
    unexpected = sorted(PREFIX + n for n in names - params.keys())
    misshaped = [f"{PREFIX}{n}: checkpoint {list(source.meta(PREFIX + n)[0])}, model expects {list(p.shape)}"
                 for n, p in params.items() if n in names and tuple(source.meta(PREFIX + n)[0]) != tuple(p.shape)]
    if missing or unexpected or misshaped:
        lines = ["checkpoint does not match the vision tower:"]
        lines += [f"  missing: {n}" for n in missing] + [f"  unexpected: {n}" for n in unexpected]
        lines += [f"  mis-shaped: {n}" for n in misshaped]
        raise CheckpointError("\n".join(lines))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(source.get(PREFIX + n))
    for block in tower.blocks:
        block.mlp.fuse()
    return len(params)
