"""Repetition, frequency and presence penalties applied to a batch's logits in place, from per-request token counts.

For each penalized row ``i``: ``x[index[i]]`` is penalized with the counts of state row ``rows[i]``: ``counts``
[S, V] (how often each token occurs in the request's output) and ``prompt`` [S, V] bool (which tokens its prompt
holds). Repetition divides a positive logit of a token seen in the prompt or output by ``rep[i]`` and multiplies a
negative one; frequency subtracts the count x ``freq[i]``; presence subtracts ``pres[i]`` once. One program per
(row, block of the vocabulary) reads the logits and the two state rows once and writes the logits back: one
launch and one pass where the tensor form is a dozen ops (gathers, casts, ``where``s, an indexed write), each a
launch on the host and a pass over ``[rows, V]`` on the device. The counts themselves are kept by
``flashinfra.engine.penalties``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast

BV = 1024  # vocabulary entries per program


@triton.jit
def penalize_kernel(x, index, rows, counts, prompt, rep, freq, pres, V, stride_x, BV: tl.constexpr):
    i_p, i_v = tl.program_id(0), tl.program_id(1)
    i_x = tl.load(index + i_p).to(tl.int64)
    i_s = tl.load(rows + i_p).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_c = tl.load(counts + i_s * V + o_v, mask=m_v, other=0).to(tl.float32)
    b_p = tl.load(prompt + i_s * V + o_v, mask=m_v, other=0) != 0
    b_x = tl.load(x + i_x * stride_x + o_v, mask=m_v, other=0.0)
    r, f, p = tl.load(rep + i_p), tl.load(freq + i_p), tl.load(pres + i_p)
    b_x = tl.where(b_p | (b_c > 0), tl.where(b_x > 0, b_x / r, b_x * r), b_x)
    b_x = b_x - f * b_c - p * (b_c > 0).to(tl.float32)
    tl.store(x + i_x * stride_x + o_v, b_x, mask=m_v)


def _check(x, index, rows, counts, prompt, rep, freq, pres) -> None:
    P = index.shape[0]
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"penalize: x must be float32 [N, V] with unit column stride, got {x.dtype} {tuple(x.shape)}")
    if counts.shape != prompt.shape or counts.shape[-1] != x.shape[-1] or not counts.is_contiguous() \
            or not prompt.is_contiguous() or prompt.dtype != torch.bool:
        raise ValueError(f"penalize: counts {tuple(counts.shape)} and bool prompt {tuple(prompt.shape)} must be "
                         f"contiguous [S, {x.shape[-1]}]")
    if any(t.shape[0] != P for t in (rows, rep, freq, pres)):
        raise ValueError(f"penalize: index, rows, rep, freq and pres must have {P} entries")


def penalize_launch(x, index, rows, counts, prompt, rep, freq, pres) -> torch.Tensor:
    """In place on ``x`` [N, V] float32; ``index`` / ``rows`` [P] integer, ``rep`` / ``freq`` / ``pres`` [P] or
    [P, 1] float32. Returns ``x``."""
    _check(x, index, rows, counts, prompt, rep, freq, pres)
    P, V = index.shape[0], x.shape[-1]
    if P and V:
        fast(penalize_kernel)[(P, cdiv(V, BV))](x, index, rows, counts, prompt, rep, freq, pres, V,
                                                x.stride(0), BV=BV, num_warps=4)
    return x


def penalize_ref(x: torch.Tensor, prompt: torch.Tensor, counts: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor,
                 pres: torch.Tensor) -> torch.Tensor:
    """The penalized rows of ``x`` [N, V] (a new tensor): ``prompt`` [N, V] bool, ``counts`` [N, V], ``rep`` /
    ``freq`` / ``pres`` [N, 1], in ``x``'s dtype."""
    counts = counts.to(x.dtype)
    seen = prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0).to(x.dtype)


def penalize(x, index, rows, counts, prompt, rep, freq, pres) -> torch.Tensor:
    """``penalize_launch``'s contract, by the kernel where the tensors run one, else by ``penalize_ref``."""
    if use_triton(x, counts):
        return penalize_launch(x, index, rows, counts, prompt, rep, freq, pres)
    _check(x, index, rows, counts, prompt, rep, freq, pres)
    index, rows = index.long(), rows.long()
    x[index] = penalize_ref(x[index], prompt[rows], counts[rows], rep.view(-1, 1), freq.view(-1, 1),
                            pres.view(-1, 1))
    return x
