"""``QuantizedWeight``: a weight stored as 8-bit data plus scales, and the quantizers that make one.

Two schemes, both symmetric:

- ``"w8a8"``: int8 data ``[..., N, K]`` and one float32 scale per output channel ``[..., N]``;
  ``w = data * scale[..., None]``. Activations are quantized per token at run time (``kernels.quant.act``).
- ``"fp8"``: float8 e4m3 data ``[..., N, K]`` and one float32 scale per ``block`` (128 x 128) tile
  ``[..., ceil(N/128), ceil(K/128)]`` (the released checkpoints' ``weight_scale_inv``); activations are
  quantized per token per 128 channels at run time.

A leading expert dimension (``[E, N, K]``) is allowed in both. The dataclass holds no logic a kernel needs
beyond its fields: kernels take ``data`` and ``scale`` as plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = (128, 128)
SCHEMES = ("w8a8", "fp8")
# a stacked [E, N, K] weight larger than this is quantized a few experts at a time, so that the float32 temporaries
# stay small beside the model (a full-width MoE layer's w13 is 19 GB in float32)
CHUNK_ELEMENTS = 1 << 27


@dataclass
class QuantizedWeight:
    data: torch.Tensor  # int8 (w8a8) or float8_e4m3fn (fp8), [..., N, K]
    scale: torch.Tensor  # float32: [..., N] (w8a8) or [..., ceil(N/bn), ceil(K/bk)] (fp8)
    scheme: str
    block: tuple[int, int] = FP8_BLOCK  # fp8 only

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}; choose one of {SCHEMES}")
        want = torch.int8 if self.scheme == "w8a8" else FP8_DTYPE
        if self.data.dtype != want or self.scale.dtype != torch.float32:
            raise ValueError(f"{self.scheme} weight: data {self.data.dtype} / scale {self.scale.dtype}, "
                             f"expected {want} / torch.float32")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __getitem__(self, i) -> "QuantizedWeight":
        """One expert of a stacked ``[E, N, K]`` weight."""
        return QuantizedWeight(self.data[i], self.scale[i], self.scheme, self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.scheme == "w8a8":
            return (self.data.to(torch.float64) * self.scale.double()[..., None]).to(dtype)
        return dequantize_blocks(self.data, self.scale, self.block).to(dtype)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, ties away from zero: what the kernels compute (``floor(|v| + 0.5)``)."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _chunk(w: torch.Tensor) -> int:
    """Leading-dim entries (experts) of ``w`` [E, N, K] quantized at a time: 0 for all at once."""
    if w.dim() < 3 or w.numel() <= CHUNK_ELEMENTS:
        return 0
    step = max(1, CHUNK_ELEMENTS // w[0].numel())
    return step if step < w.shape[0] else 0


def quantize_int8_per_channel(w: torch.Tensor) -> QuantizedWeight:
    """``w`` [..., N, K] -> int8 with one scale per row (``amax / 127``, 1 for an all-zero row)."""
    if step := _chunk(w):  # the same values, expert by expert (each expert's rows are its own)
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scale = torch.empty(w.shape[:-1], dtype=torch.float32, device=w.device)
        for i in range(0, w.shape[0], step):
            part = quantize_int8_per_channel(w[i:i + step])
            q[i:i + step], scale[i:i + step] = part.data, part.scale
        return QuantizedWeight(q, scale, "w8a8")
    wf = w.float()
    amax = wf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = round_half_away(wf / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return QuantizedWeight(q, scale.float().contiguous(), "w8a8")


def _blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """``x`` [..., N, K] zero-padded to whole blocks and viewed as [..., N/bn, bn, K/bk, bk]."""
    bn, bk = block
    N, K = x.shape[-2:]
    pn, pk = -N % bn, -K % bk
    if pn or pk:
        x = torch.nn.functional.pad(x, (0, pk, 0, pn))
    return x.reshape(*x.shape[:-2], (N + pn) // bn, bn, (K + pk) // bk, bk), N, K


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> QuantizedWeight:
    """``w`` [..., N, K] -> e4m3 with one scale per ``block`` tile (``amax / 448``, 1 for an all-zero tile)."""
    if step := _chunk(w):  # the same values, expert by expert (tiles never span experts)
        N, K = w.shape[-2:]
        q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
        scale = torch.empty(*w.shape[:-2], -(-N // block[0]), -(-K // block[1]), dtype=torch.float32,
                            device=w.device)
        for i in range(0, w.shape[0], step):
            part = quantize_fp8_blocks(w[i:i + step], block)
            q[i:i + step], scale[i:i + step] = part.data, part.scale
        return QuantizedWeight(q, scale, "fp8", tuple(block))
    b, N, K = _blocks(w.float(), block)
    amax = b.abs().amax(dim=(-3, -1))  # [..., N/bn, K/bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (b / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*q.shape[:-4], q.shape[-4] * q.shape[-3], q.shape[-2] * q.shape[-1])[..., :N, :K]
    return QuantizedWeight(q.contiguous(), scale.contiguous(), "fp8", tuple(block))


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-scaled ``data`` [..., N, K] -> float64 ``data * scale`` (exact: e4m3 times a float32 fits)."""
    bn, bk = block
    N, K = data.shape[-2:]
    s = scale.double().repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return data.double() * s
