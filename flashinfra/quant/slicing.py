"""Slicing a weight, float or 8-bit, by output rows, input columns or experts: what a tensor-parallel rank keeps.

A float tensor is sliced as it is. A ``QuantizedWeight`` keeps its codes as they are and takes the scales that
cover them, so a rank's weight is exactly its slice of the one-rank quantization:

- ``w8a8`` (one scale per output row): rows take their scales; columns keep every row's scale whole (the scale
  was computed over the whole row, and the row's codes are those of that scale).
- ``fp8`` (one scale per 128 x 128 block): a slice keeps the blocks it lies in. It must start on a block
  boundary, or lie inside one block (a few rows of a small tensor, such as KDA's beta rows split by head);
  pieces concatenated along the rows must be whole blocks but for the last. Anything else would need codes
  re-scaled to new blocks, so it is refused (``BlockSplitError``, naming the tensor and the sizes).
"""

from __future__ import annotations

import torch

from flashinfra.quant.weights import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


class BlockSplitError(ValueError):
    """A slice of a block-FP8 weight that does not keep whole blocks; the message names the tensor and sizes."""


def _block_range(sl: slice, n: int, block: int, name: str, what: str) -> slice:
    """The blocks that hold ``sl`` of ``n`` rows (or columns); refused when the slice cuts blocks apart."""
    a, b = sl.start, sl.stop
    if a % block and a // block != (b - 1) // block:
        raise BlockSplitError(f"{name}: {what} {a}:{b} of {n} start inside a {block}-wide FP8 block and span "
                              f"several ({b - a} per rank is not a whole number of {block}-wide blocks)")
    return slice(a // block, (b - 1) // block + 1)


def take_rows(w: Weight, sl: slice, name: str) -> Weight:
    """Output rows ``sl`` of ``w`` [..., N, K] (or of a vector [N])."""
    if not isinstance(w, QuantizedWeight):
        return w[..., sl, :] if w.dim() > 1 else w[sl]
    if w.scheme == "w8a8":
        return QuantizedWeight(w.data[..., sl, :], w.scale[..., sl], "w8a8")
    blocks = _block_range(sl, w.shape[-2], w.block[0], name, "rows")
    return QuantizedWeight(w.data[..., sl, :], w.scale[..., blocks, :], "fp8", w.block)


def take_cols(w: Weight, sl: slice, name: str) -> Weight:
    """Input columns ``sl`` of ``w`` [..., N, K]."""
    if not isinstance(w, QuantizedWeight):
        return w[..., sl]
    if w.scheme == "w8a8":
        return QuantizedWeight(w.data[..., sl], w.scale, "w8a8")
    blocks = _block_range(sl, w.shape[-1], w.block[1], name, "columns")
    return QuantizedWeight(w.data[..., sl], w.scale[..., blocks], "fp8", w.block)


def take_experts(w: Weight, experts: slice) -> Weight:
    """Whole experts ``experts`` of a stacked ``[E, N, K]`` weight, with their scales."""
    return w[experts]


def cat_rows(parts: list[Weight], name: str) -> Weight:
    """Pieces of rows (each from ``take_rows``) concatenated along the rows."""
    if not isinstance(parts[0], QuantizedWeight):
        return torch.cat(parts, dim=-2)
    w = parts[0]
    if w.scheme == "fp8":
        bn = w.block[0]
        for p in parts[:-1]:
            if p.shape[-2] % bn:
                raise BlockSplitError(f"{name}: a piece of {p.shape[-2]} rows per rank is not a whole number of "
                                      f"{bn}-row FP8 blocks, so the next piece's blocks would not line up")
    scale_rows = -1 if w.scheme == "w8a8" else -2  # [..., N] per row, or [..., N / bn, K / bk] per block
    return QuantizedWeight(torch.cat([p.data for p in parts], dim=-2),
                           torch.cat([p.scale for p in parts], dim=scale_rows), w.scheme, w.block)


def owned(w: Weight) -> Weight:
    """``w`` in storage of its own (contiguous), so that the tensor it was sliced from can be freed."""
    if not isinstance(w, QuantizedWeight):
        return w.contiguous().clone()
    return QuantizedWeight(w.data.contiguous().clone(), w.scale.contiguous().clone(), w.scheme, w.block)
