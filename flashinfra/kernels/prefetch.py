"""Weights asked of the L2 cache ahead of the GEMM that reads them, while the kernels before it run.

A decode step of a few tokens streams its weights GEMM after GEMM, and between two GEMMs runs a chain of small kernels
that move almost no bytes (mHC's weights and Sinkhorn iterations, norms, the router, the MoE's alignment): the memory
idles through them. ``prefetch_l2(w, tokens)``, called where such a chain begins, launches one small kernel whose
threads each ask L2 for a 16 KB piece of the first ``env.prefetch_bytes()`` of ``w`` (Hopper's bulk prefetch,
``cp.async.bulk.prefetch.L2``: no registers, no shared memory, nothing to wait for), so that the GEMM finds that much
of its weight in L2 and streams the rest.

In the chain of programmatic dependent launches (``launch.pdl_wait``) the prefetch kernel's programs start while the
kernel before them still runs, issue their requests at once and only then wait for it, so the requests overlap
that kernel too; they wait before they finish because a kernel that finished earlier than the one before it would
let the next one start too soon. A prefetch changes no value: the outputs are the same bits with or without it.

Only on a Hopper GPU (the bulk prefetch is sm_90's), at decode sizes (``PREFETCH_TOKENS``; a prompt's GEMMs are
compute-bound), and off under the interpreter; ``FLASHINFRA_PREFETCH_MB=0`` turns it off, to compare.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flashinfra import env
from flashinfra.kernels.dispatch import interpreting
from flashinfra.kernels.launch import cdiv, fast, pdl_wait

PREFETCH_TOKENS = 64  # the most tokens a step may have for its weights to be prefetched
CHUNK = 16384  # bytes a thread asks for (a multiple of 16)
THREADS = 128  # a program's threads: 4 warps, one chunk each


@triton.jit
def prefetch_l2_kernel(p, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    o = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - o, CHUNK).to(tl.int32)  # a multiple of 16; none past the end
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [p + o, size], dtype=tl.int32, is_pure=False, pack=1)
    pdl_wait(PDL)


_hopper: dict[int, bool] = {}
_budget = functools.cache(env.prefetch_bytes)


def _has_bulk_prefetch(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper:
        _hopper[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _hopper[index]


def prefetch_l2(weight, tokens: int) -> None:
    """Ask L2 for the first ``env.prefetch_bytes()`` of ``weight`` (a tensor, or an 8-bit weight's codes: its
    ``data``; None is none) ahead of a step of ``tokens`` tokens' GEMM over it; nothing off a Hopper GPU, above
    ``PREFETCH_TOKENS`` or when turned off."""
    budget = _budget()
    if budget <= 0 or tokens > PREFETCH_TOKENS or weight is None:
        return
    w = weight.data
    if (not w.is_cuda or interpreting() or not w.is_contiguous()
            or w.data_ptr() % 16 or not _has_bulk_prefetch(w.device)):
        return
    nbytes = min(budget, w.numel() * w.element_size()) // 16 * 16
    if nbytes:  # as bytes, whatever the weight's dtype
        fast(prefetch_l2_kernel)[(cdiv(nbytes, CHUNK * THREADS),)](w.reshape(-1).view(torch.int8), nbytes,
                                                                   CHUNK=CHUNK, BLOCK=THREADS, num_warps=THREADS // 32)
