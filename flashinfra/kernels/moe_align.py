"""The sorted dispatch of the fused MoE (``fused_moe.py``): the ``T * k`` (token, expert) pairs grouped by expert
in runs padded to the GEMMs' ``BM``-row blocks, with the expert of each block. A counting sort on the device, with
no host sync, so that it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashinfra.kernels.launch import fast


@triton.jit
def moe_place_kernel(ids, starts, fill, sorted_ids, num_pairs, BLOCK: tl.constexpr):
    """Each pair takes the next free row of its expert's run (an atomic counter per expert)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < num_pairs
    e = tl.load(ids + o, mask=m, other=0)
    row = tl.load(starts + e, mask=m, other=0) + tl.atomic_add(fill + e, 1, mask=m)
    tl.store(sorted_ids + row, o.to(tl.int32), mask=m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, BM: int):
    """-> (sorted pair ids [S] int32 (padding: T*k), expert of each BM block [S / BM] int32, used length [1]).

    The order of pairs inside an expert's run follows the atomics (it varies from run to run), which
    changes no result: each row of a GEMM tile is computed on its own, and ``moe_sum_kernel`` adds a
    token's pair outputs in pair order."""
    flat = topk_ids.reshape(-1)
    Tk, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev).scatter_add_(
        0, flat.long(), torch.ones(Tk, dtype=torch.int32, device=dev))
    padded = (counts + BM - 1) // BM * BM
    ends = padded.cumsum(0, dtype=torch.int32)
    S = triton.cdiv(min(Tk + num_experts * (BM - 1), Tk * BM), BM) * BM
    sorted_ids = torch.full((S,), Tk, dtype=torch.int32, device=dev)
    fill = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    BLOCK = 256
    fast(moe_place_kernel)[(triton.cdiv(Tk, BLOCK),)](flat.to(torch.int32).contiguous(), ends - padded, fill,
                                                     sorted_ids, Tk, BLOCK=BLOCK, num_warps=4)
    starts = torch.arange(0, S, BM, device=dev, dtype=torch.int32)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:]
