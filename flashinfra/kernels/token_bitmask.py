"""A grammar's token bitmask applied to the logits: in the rows a grammar constrains, every token whose bit is 0 gets
-inf (token t is bit t % 32 of word t // 32, xgrammar's layout); the other rows, and the columns from
``vocab_size`` on, are left as they are.

``bitmask`` [R, W] int32 holds the constrained rows only, in any order, and ``rows`` [R] the logits row of each
(distinct), both on the logits' device, so one launch masks a batch whatever rows are free. The kernel reads each
word once and only stores (the -inf entries); it never reads the logits. What it leaves out: filling the bitmask
(``flashinfra.engine.grammar``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast

BV = 1024  # tokens per program: 32 bitmask words
_BITS = [1 << i for i in range(31)] + [-(1 << 31)]  # bit i of an int32 word


@triton.jit
def apply_token_bitmask_kernel(logits, bitmask, rows, vocab_size, stride_l, W, BV: tl.constexpr):
    i_r, i_v = tl.program_id(0), tl.program_id(1)
    i_row = tl.load(rows + i_r).to(tl.int64)
    o_w = i_v * (BV // 32) + tl.arange(0, BV // 32)
    b_w = tl.load(bitmask + i_r.to(tl.int64) * W + o_w, mask=o_w < W, other=-1)
    b_off = ((b_w[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0  # [BV // 32, 32]: token w * 32 + bit
    b_off = tl.reshape(b_off, (BV,))
    o_v = i_v * BV + tl.arange(0, BV)
    tl.store(logits + i_row * stride_l + o_v, float("-inf"), mask=b_off & (o_v < vocab_size))


def apply_token_bitmask_launch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                               vocab_size: int) -> torch.Tensor:
    """In place on ``logits`` [N, V] (unit column stride); returns it."""
    R, W = bitmask.shape
    V = min(vocab_size, logits.shape[-1], W * 32)
    if logits.dim() != 2 or logits.stride(-1) != 1 or not bitmask.is_contiguous() or bitmask.dtype != torch.int32:
        raise ValueError("apply_token_bitmask: logits [N, V] with unit column stride, bitmask contiguous int32 [R, W]")
    if rows.shape != (R,):
        raise ValueError(f"apply_token_bitmask: rows {tuple(rows.shape)} for a bitmask of {R} rows")
    if R and V:
        fast(apply_token_bitmask_kernel)[(R, cdiv(V, BV))](logits, bitmask, rows, V, logits.stride(0), W,
                                                           BV=BV, num_warps=4)
    return logits


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                            vocab_size: int) -> torch.Tensor:
    R, W = bitmask.shape
    V = min(vocab_size, logits.shape[-1], W * 32)
    if not R or not V:
        return logits
    bits = torch.tensor(_BITS, dtype=torch.int32, device=bitmask.device)
    off = (bitmask[:, :, None] & bits).view(R, W * 32)[:, :V] == 0
    rows = rows.long()
    logits[rows, :V] = logits[rows, :V].masked_fill(off, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    if use_triton(logits, bitmask, rows):
        return apply_token_bitmask_launch(logits, bitmask, rows, vocab_size)
    return apply_token_bitmask_ref(logits, bitmask, rows, vocab_size)
