"""MoE router: sigmoid scores, group-limited top-k with the correction bias, normalised and scaled weights.

``route_ref`` is the reference (GLM / DeepSeek-V3 style): ``scores = sigmoid(x W^T)`` in float32; the
choice uses ``scores + bias``; groups are ranked by the sum of their two best biased scores and only the
``topk_group`` best groups stay eligible; the chosen experts' unbiased scores are normalised (when
``norm_topk_prob``) and multiplied by ``routed_scaling_factor``.

Triton path: for a few tokens (a decode step, whose cost is the float32 weight's bytes) ``router_logits_kernel``
computes the float32 logits from the activations as they are (bfloat16 rows widened in registers, not copied),
float32 products summed over whole rows, two experts a program; above, and in deterministic mode (a row's sums in
one order whatever the batch), the rows widened to float32 and cuBLAS's float32 GEMM (tensor-core products in
three parts lose low bits in the tensor cores' accumulation, which the router's close scores turn into other
experts: ``bench/notes/moe.md``). ``route_kernel`` then does everything else, one token per single-warp
program with all experts of the token in registers (``k`` rounds of arg-max), so routing is two launches whatever
the number of groups. The selected experts come out in
descending order of their biased score; exact ties between scores (which random float weights do not
produce) may be broken differently from ``torch.topk``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashinfra.kernels.batch_invariant import linear
from flashinfra.kernels.dispatch import is_deterministic, use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait
from flashinfra.kernels.moe_align import Aligned, align_one, aligned_buffers, bins, one_program_scratch
from flashinfra.kernels.moe_tiles import moe_tiles

# Tokens up to which the logits are float32 products summed over whole rows, two experts a program (144 programs
# streaming the weight); above, and in deterministic mode, cuBLAS's float32 GEMM of the widened rows.
FMA_ROWS = 4


def route_ref(
    x: torch.Tensor,  # [T, D]
    weight: torch.Tensor,  # [E, D] float32
    bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, ids [T, top_k] int64
    E = weight.shape[0]
    scores = F.linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    choice = choice.masked_fill(~group_mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids


@triton.jit
def router_logits_kernel(x, w, out, T, E, D, stride_x, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Grid (cdiv(T, BM), cdiv(E, BN)): ``out[t, e] = x[t] . w[e]`` in float32 (``x`` [T, D] of any float dtype,
    ``w`` [E, D] float32), as float32 products summed over whole rows: ``BK`` covers D, so each program asks for
    its rows once."""
    pdl_wait(PDL)
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n, m_k = o_m < T, o_n < E, o_k < D
    b_x = tl.load(x + o_m[:, None].to(tl.int64) * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                  other=0.0).to(tl.float32)
    b_w = tl.load(w + o_n[:, None].to(tl.int64) * D + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
    acc = tl.sum(b_x[:, None, :] * b_w[None, :, :], 2)
    tl.store(out + o_m[:, None].to(tl.int64) * E + o_n[None, :], acc, mask=m_m[:, None] & m_n[None, :])


def router_logits_launch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` [T, D] (a few rows) times the float32 router weight [E, D] -> float32 logits [T, E]."""
    T, D = x.shape
    E = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.float().contiguous()
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T:
        BM = min(FMA_ROWS, next_power_of_2(T))
        fast(router_logits_kernel)[(cdiv(T, BM), cdiv(E, 2))](x, weight, out, T, E, D, x.stride(0), BM=BM, BN=2,
                                                              BK=next_power_of_2(D), num_warps=8)
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's float32 logits on the kernel path: ``router_logits_kernel`` up to ``FMA_ROWS`` tokens, else
    the rows widened and cuBLAS's float32 GEMM (in deterministic mode, the batch-invariant one)."""
    if x.shape[0] <= FMA_ROWS and not is_deterministic():
        return router_logits_launch(x, weight)
    return linear(x.float(), weight.float()).contiguous()


@triton.jit
def route_kernel(logits, bias, w_out, id_out, T, E, scaling, TOPK: tl.constexpr, G: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
                 TOPK_P2: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    _route(logits, bias, w_out, id_out, tl.program_id(0) * BT + tl.arange(0, BT), T, E, scaling, TOPK, G,
           TOPK_GROUP, NORM, BT, BE, TOPK_P2)


@triton.jit(do_not_specialize=["T"])  # 1 to FMA_ROWS tokens: one compilation for each BT
def route_align_kernel(logits, bias, w_out, id_out, scratch, sorted_ids, expert_ids, used, T, E, scaling,
                       TOPK: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                       BT: tl.constexpr, BE: tl.constexpr, TOPK_P2: tl.constexpr, E_P2: tl.constexpr,
                       BM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """A decode step's few tokens (``BT`` covers them all) routed, then their pairs aligned for the fused MoE
    (``moe_align.align_one``), in one program."""
    pdl_wait(PDL)
    _route(logits, bias, w_out, id_out, tl.arange(0, BT), T, E, scaling, TOPK, G, TOPK_GROUP, NORM, BT, BE, TOPK_P2)
    tl.debug_barrier()  # the chosen ids, seen by every thread of the program
    align_one(id_out, scratch, sorted_ids, expert_ids, used, T * (TOPK + 1), E, TOPK, E_P2, BM, BLOCK)


@triton.jit
def _route(logits, bias, w_out, id_out, o_t, T, E, scaling, TOPK: tl.constexpr, G: tl.constexpr,
           TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, TOPK_P2: tl.constexpr):
    """Tokens ``o_t`` (``BT`` of them)' choices from their logits: ``route_ref`` after the logits."""
    o_e = tl.arange(0, BE)
    m_t, m_e = o_t < T, o_e < E
    neg = float("-inf")
    b_l = tl.load(logits + o_t[:, None] * E + o_e[None, :], mask=m_t[:, None] & m_e[None, :], other=0.0)
    scores = tl.sigmoid(b_l)
    choice = tl.where(m_e[None, :], scores + tl.load(bias + o_e, mask=m_e, other=0.0)[None, :], neg)
    if G > 1:
        gsize = E // G
        gid = o_e // gsize
        gscore = tl.zeros([BT, BE], dtype=tl.float32)
        for g in tl.static_range(G):
            c = tl.where((gid == g)[None, :], choice, neg)
            first = tl.argmax(c, 1)
            c2 = tl.where(o_e[None, :] == first[:, None], neg, c)
            gscore = tl.where((gid == g)[None, :], (tl.max(c, 1) + tl.max(c2, 1))[:, None], gscore)
        keep = tl.zeros([BT, BE], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(tl.where(keep | ~m_e[None, :], neg, gscore), 1) // gsize
            keep = keep | (gid[None, :] == best[:, None])
        choice = tl.where(keep, choice, neg)
    # the k choices gathered in registers, then stored once (a load of what a store just wrote is a round trip)
    o_k = tl.arange(0, TOPK_P2)
    picks = tl.zeros([BT, TOPK_P2], dtype=tl.int32)
    ws = tl.zeros([BT, TOPK_P2], dtype=tl.float32)
    total = tl.zeros([BT], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pick = tl.argmax(choice, 1)
        hit = o_e[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), 1)
        total += w
        choice = tl.where(hit, neg, choice)
        picks = tl.where(o_k[None, :] == j, pick[:, None], picks)
        ws = tl.where(o_k[None, :] == j, w[:, None], ws)
    if NORM:
        factor = scaling / (total + 1e-20)
    else:
        factor = tl.full([BT], scaling, tl.float32)
    m_k = m_t[:, None] & (o_k < TOPK)[None, :]
    tl.store(id_out + o_t[:, None] * TOPK + o_k[None, :], picks.to(id_out.dtype.element_ty), mask=m_k)
    tl.store(w_out + o_t[:, None] * TOPK + o_k[None, :], ws * factor[:, None], mask=m_k)


def _check_groups(E: int, top_k: int, n_group: int, topk_group: int) -> None:
    if E % n_group or not 1 <= topk_group <= n_group or top_k > E // n_group * topk_group:
        raise ValueError(f"route: {E} experts, {n_group} groups, topk_group {topk_group}, top_k {top_k} do not fit")


def _choices(T: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing's outputs: weights [T, top_k] float32, ids [T, top_k] int32."""
    return (torch.empty(T, top_k, dtype=torch.float32, device=device),
            torch.empty(T, top_k, dtype=torch.int32, device=device))


def route_launch(x, weight, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float):
    """-> (weights [T, top_k] float32, ids [T, top_k] int32)."""
    E = weight.shape[0]
    _check_groups(E, top_k, n_group, topk_group)
    logits = router_logits(x, weight)
    T = x.shape[0]
    w, ids = _choices(T, top_k, x.device)
    if T:
        # one warp per token: the k arg-max rounds reduce with warp shuffles only (several warps per program
        # would reduce through shared memory, a round trip per round)
        BE = next_power_of_2(E)
        fast(route_kernel)[(T,)](logits, bias.float().contiguous(), w, ids, T, E, float(scaling), TOPK=top_k,
                                 G=n_group, TOPK_GROUP=topk_group, NORM=norm_topk_prob, BT=1, BE=BE,
                                 TOPK_P2=next_power_of_2(top_k),
                                 num_warps=1 if BE <= 1024 else 4)
    return w, ids


def route(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    if use_triton(x, weight, bias):
        return route_launch(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
    return route_ref(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)


def route_align_launch(x, weight, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                       scaling: float):
    """``route_launch`` for 1 to ``FMA_ROWS`` tokens, with the fused MoE's alignment of their pairs formed in the
    routing's program -> (weights, ids, ``Aligned``), laid out for the block rows the MoE's GEMMs take at these
    tokens (``moe_tiles``)."""
    _check_groups(weight.shape[0], top_k, n_group, topk_group)
    T, E, dev = x.shape[0], weight.shape[0], x.device
    if not 0 < T <= FMA_ROWS:
        raise ValueError(f"route_align: {T} tokens, the one-program routing takes 1 to {FMA_ROWS}")
    logits = router_logits_launch(x, weight)
    n = T * (top_k + 1)
    BM = moe_tiles(n, E + 1)["BM"]
    sorted_ids, expert_ids = aligned_buffers(T, top_k, E, BM, dev)
    scratch, used = one_program_scratch(E, dev)
    w, ids = _choices(T, top_k, dev)
    BT, BE = next_power_of_2(T), next_power_of_2(E)
    fast(route_align_kernel)[(1,)](logits, bias.float().contiguous(), w, ids, scratch, sorted_ids, expert_ids, used,
                                   T, E, float(scaling), TOPK=top_k, G=n_group, TOPK_GROUP=topk_group,
                                   NORM=norm_topk_prob, BT=BT, BE=BE, TOPK_P2=next_power_of_2(top_k), E_P2=bins(E),
                                   BM=BM, BLOCK=max(16, next_power_of_2(n)), num_warps=1 if BT * BE <= 1024 else 4)
    return w, ids, Aligned(sorted_ids, expert_ids, used, BM)


def route_aligned(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """``route`` -> (weights, ids, aligned or None): a decode step's few tokens on the kernel path also get the fused
    MoE's alignment of their pairs from the routing's launch (``route_align_launch``; not in deterministic mode,
    whose logits take the batch-invariant GEMM); the MoE aligns them itself otherwise."""
    if use_triton(x, weight, bias) and 0 < x.shape[0] <= FMA_ROWS and not is_deterministic():
        return route_align_launch(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)
    return (*route(x, weight, bias, top_k, n_group, topk_group, norm_topk_prob, scaling), None)
