"""Fused MoE experts: sorted dispatch, grouped GEMMs with the clamped SwiGLU, weighted combine, shared expert.

``experts_ref`` is the reference (a loop over the used experts). The Triton path:

1. ``moe_align`` (its own module): the ``T (k + 1)`` (token, expert) pairs, the shared expert's included,
   grouped by expert (a counting sort: counts, padded offsets, then each pair dropped into its expert's run), each
   run padded to a multiple of ``BM``, so every ``BM``-row block of the list belongs to one expert. No host sync,
   so it can be captured in a CUDA graph; its size is a static bound and blocks past the real end exit at once.
2. ``moe_gemm1_kernel``: per block of ``BM`` pairs and ``BN`` intermediate columns, the gate and up
   products of that expert (two accumulators over the same ``x`` tile), then ``silu(min(gate, L)) *
   clamp(up, -L, L)``, written once per pair.
3. ``moe_gemm2_kernel``: the down projection of each pair, times its routing weight (1 for the shared pair).
4. ``moe_sum_kernel``: per token, the sum of its ``k + 1`` pair outputs.

Both GEMMs run on a flat grid in ``_tile``'s order: all column tiles of two neighbouring pair blocks before the next
two, so that an expert's weight tiles and a block's activation rows are read from memory about once.

The shared expert is one more pair per token (expert id ``E``, weight 1, the last of the token's ``k + 1``) in the
same launches, its weights addressed as an offset from the routed experts' base pointer (no copy into one tensor);
the router's ``[T, k]`` ids and weights are read as they are, the shared pair's implied.
Only the weights of experts that received a token are read: at batch 1 that is ``k`` experts, which is
what makes decode memory-bound on exactly the bytes it must touch.

Weight formats (``WEIGHTS``, a constexpr read from the weights' dtype), each with its scales beside the weights
(routed and shared, the shared ones addressed as an offset like the weights):

- ``float``: bf16 (float32 in tests) weights and activations, float32 accumulators.
- ``int8`` (W8A8): int8 weights with one scale per output channel; ``x`` and the intermediate are quantized per
  row (``act.quant_act``: a row's scale needs the whole row, which no GEMM program sees; ``x``'s codes may come
  from its producer instead, ``x_codes``: the RMSNorm's epilogue), the products sum exactly in int32 and both
  scales are applied once, in the epilogue.
- ``fp8``: e4m3 weights with one scale per 128 x 128 tile; ``x`` and the intermediate are quantized per row per
  128 channels, and each 128-wide K step's float32 product is scaled by its
  activation and weight block scales before it is accumulated (the DeepSeek-V3 recipe). The gate and up halves
  need ``I % 128 == 0`` unless the scales were made for the stacked ``[2I, D]`` (``flashinfra.quant`` does that).

Sorting, the grid, the SwiGLU, the routing weights and the combine are the same for all three; only the
accumulator type, the per-step scaling (fp8) and the epilogue scaling (int8) differ, behind the constexpr.
``fused_moe_ref`` is the reference: the float loop, or for 8-bit weights ``experts_8bit_ref``, the same
quantized arithmetic in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashinfra.kernels.batch_invariant import linear
from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.launch import cdiv, fast, next_power_of_2, pdl_wait
from flashinfra.kernels.moe_align import moe_align
from flashinfra.kernels.moe_tiles import moe_tiles
from flashinfra.kernels.quant.act import GROUP, WEIGHT_FORMATS, quant_act, quant_act_ref
from flashinfra.kernels.quant.gemm import fp8_step, matmul_8bit_ref

# pair blocks whose column tiles the grid interleaves (``_tile``): an expert's pairs fill about two 128-row blocks in
# a long prefill (8192 tokens x 9 pairs over 289 experts)
PAIR_BLOCKS_PER_GROUP = tl.constexpr(2)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts_ref(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
    limit: float,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        h = F.linear(clamped_swiglu(F.linear(x[token], w13[e]), limit), w2[e])
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(out.dtype))
    return out


def experts_8bit_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, limit: float, x_codes=None) -> torch.Tensor:
    """The 8-bit experts' arithmetic in float64: activations quantized as the kernels do, the intermediate
    rounded to x's dtype and quantized again, each weighted pair output rounded to x's dtype."""
    fmt = weight_format(w13)
    T, D = x.shape
    N = w13.shape[1] // 2
    xq, sx = quant_act_ref(fmt, x) if x_codes is None else x_codes
    out = torch.zeros(T, D, dtype=torch.float64, device=x.device)
    for e in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == e)
        gu = matmul_8bit_ref(xq[token], sx[token], w13[e], s13[e], out_dtype=torch.float64)
        gate, up = gu[:, :N].clamp(max=limit), gu[:, N:].clamp(min=-limit, max=limit)
        hq, sh = quant_act_ref(fmt, (gate * torch.sigmoid(gate) * up).to(x.dtype))
        y = matmul_8bit_ref(hq, sh, w2[e], s2[e], out_dtype=torch.float64)
        out.index_add_(0, token, (y * topk_weights[token, slot].double()[:, None]).to(x.dtype).double())
    return out.to(x.dtype)


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, limit: float, shared_w13, shared_w2, scales=None,
                  x_codes=None):
    """Routed experts plus the shared expert (none when ``shared_w13`` is None). 8-bit experts: the shared
    expert is one more pair per token with weight 1, as in the kernels."""
    if scales is None:
        out = experts_ref(x, w13, w2, topk_weights, topk_ids, limit)
        if shared_w13 is None:
            return out
        return out + F.linear(clamped_swiglu(F.linear(x, shared_w13), limit), shared_w2)
    s13, s2, ss13, ss2 = scales
    if shared_w13 is not None:
        T, E = x.shape[0], w13.shape[0]
        w13, w2 = torch.cat([w13, shared_w13[None]]), torch.cat([w2, shared_w2[None]])
        s13, s2 = torch.cat([s13, ss13[None]]), torch.cat([s2, ss2[None]])
        topk_ids = torch.cat([topk_ids.long(), torch.full((T, 1), E, dtype=torch.long, device=x.device)], 1)
        topk_weights = torch.cat([topk_weights.float(), torch.ones(T, 1, device=x.device)], 1)
    return experts_8bit_ref(x, w13, s13, w2, s2, topk_weights, topk_ids, limit, x_codes)


@triton.jit
def _tile(N: tl.constexpr, BN: tl.constexpr):
    """This program's (block of pairs, tile of output columns). The grid is flat and goes through all column tiles of
    ``PAIR_BLOCKS_PER_GROUP`` neighbouring pair blocks, those blocks alternating, before the next group: the blocks of
    one expert then read each weight tile back to back (once from memory), and a block's activation rows stay in L2
    for all its column tiles instead of coming back after every other block's."""
    num_n: tl.constexpr = (N + BN - 1) // BN
    pid = tl.program_id(0)
    width = PAIR_BLOCKS_PER_GROUP * num_n
    first = (pid // width) * PAIR_BLOCKS_PER_GROUP
    size = tl.minimum(tl.num_programs(0) // num_n - first, PAIR_BLOCKS_PER_GROUP)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def moe_gemm1_kernel(x, w, h, sorted_ids, expert_ids, used, stride_x, stride_we, shared_off, num_pairs, limit, sx, sw,
                     stride_se, shared_soff, E: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                     WEIGHTS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_m, i_n = _tile(N, BN)
    if i_m * BM >= tl.load(used):
        return
    pair = tl.load(sorted_ids + i_m * BM + tl.arange(0, BM))
    m_p = pair < num_pairs
    tok = (pair // TOPK).to(tl.int64)
    e = tl.load(expert_ids + i_m).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    p_g = w + tl.where(e == E, shared_off, e * stride_we) + o_n[None, :].to(tl.int64) * K
    p_u = p_g + N * K
    if WEIGHTS == "int8":  # exact int32 sums, scaled once in the epilogue
        acc_g = tl.zeros([BM, BN], dtype=tl.int32)
        acc_u = tl.zeros([BM, BN], dtype=tl.int32)
    else:
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    if WEIGHTS == "fp8":  # scales [ceil(2N / BK), ceil(K / BK)] per expert: one per 128 x 128 weight tile
        KB: tl.constexpr = (K + BK - 1) // BK
        # a column tile inside one weight block takes one scale per step (``fp8_step``)
        ONE_BLOCK: tl.constexpr = BK % BN == 0 and N % BN == 0
        col = i_n * BN if ONE_BLOCK else o_n
        p_sg = sw + tl.where(e == E, shared_soff, e * stride_se) + (col // BK) * KB
        p_su = sw + tl.where(e == E, shared_soff, e * stride_se) + ((col + N) // BK) * KB
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(x + tok[:, None] * stride_x + o_k[None, :], mask=m_p[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        b_g = tl.load(p_g + o_k[:, None], mask=m_w, other=0.0)
        b_u = tl.load(p_u + o_k[:, None], mask=m_w, other=0.0)
        if IEEE:
            acc_g += tl.dot(b_x, b_g, input_precision="ieee")
            acc_u += tl.dot(b_x, b_u, input_precision="ieee")
        elif WEIGHTS == "fp8":  # each 128-wide step's product scaled by its activation and weight block scales
            b_sx = tl.load(sx + tok * KB + k0 // BK, mask=m_p, other=0.0)
            acc_g += fp8_step(tl.dot(b_x, b_g), b_sx, p_sg + k0 // BK, m_n, ONE_BLOCK)
            acc_u += fp8_step(tl.dot(b_x, b_u), b_sx, p_su + k0 // BK, m_n, ONE_BLOCK)
        else:
            acc_g += tl.dot(b_x, b_g)
            acc_u += tl.dot(b_x, b_u)
    if WEIGHTS == "int8":  # per-token activation scale times per-channel weight scale
        b_sx = tl.load(sx + tok, mask=m_p, other=0.0)[:, None]
        p_s = sw + tl.where(e == E, shared_soff, e * stride_se) + o_n
        acc_g = acc_g.to(tl.float32) * b_sx * tl.load(p_s, mask=m_n, other=0.0)[None, :]
        acc_u = acc_u.to(tl.float32) * b_sx * tl.load(p_s + N, mask=m_n, other=0.0)[None, :]
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    b_h = gate * tl.sigmoid(gate) * up
    tl.store(h + pair[:, None].to(tl.int64) * N + o_n[None, :], b_h.to(h.dtype.element_ty),
             mask=m_p[:, None] & m_n[None, :])


@triton.jit
def moe_gemm2_kernel(h, w, out, topk_w, sorted_ids, expert_ids, used, stride_we, shared_off, num_pairs, sh, sw,
                     stride_se, shared_soff, E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, WEIGHTS: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_m, i_n = _tile(N, BN)
    if i_m * BM >= tl.load(used):
        return
    pair = tl.load(sorted_ids + i_m * BM + tl.arange(0, BM))
    m_p = pair < num_pairs
    rows = pair.to(tl.int64)
    e = tl.load(expert_ids + i_m).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    p_w = w + tl.where(e == E, shared_off, e * stride_we) + o_n[None, :].to(tl.int64) * K
    if WEIGHTS == "int8":
        acc = tl.zeros([BM, BN], dtype=tl.int32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    if WEIGHTS == "fp8":
        KB: tl.constexpr = (K + BK - 1) // BK
        ONE_BLOCK: tl.constexpr = BK % BN == 0  # as in gemm1
        p_sw = sw + tl.where(e == E, shared_soff, e * stride_se) + ((i_n * BN if ONE_BLOCK else o_n) // BK) * KB
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_h = tl.load(h + rows[:, None] * K + o_k[None, :], mask=m_p[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(b_h, b_w, input_precision="ieee")
        elif WEIGHTS == "fp8":
            acc += fp8_step(tl.dot(b_h, b_w), tl.load(sh + rows * KB + k0 // BK, mask=m_p, other=0.0), p_sw + k0 // BK,
                            m_n, ONE_BLOCK)
        else:
            acc += tl.dot(b_h, b_w)
    # the pair's routing weight: token t's routed ones at topk_w [t, j], 1 for its last (shared) pair
    tok = pair // TOPK
    routed = m_p & (pair - tok * TOPK < TOPK - 1)
    pw = tl.where(routed, tl.load(topk_w + pair - tok, mask=routed, other=0.0), 1.0)
    if WEIGHTS == "int8":
        scale = tl.load(sh + rows, mask=m_p, other=0.0) * pw
        p_s = sw + tl.where(e == E, shared_soff, e * stride_se) + o_n
        acc = acc.to(tl.float32) * scale[:, None] * tl.load(p_s, mask=m_n, other=0.0)[None, :]
    else:
        acc = acc * pw[:, None]
    tl.store(out + rows[:, None] * N + o_n[None, :], acc.to(out.dtype.element_ty), mask=m_p[:, None] & m_n[None, :])


@triton.jit
def moe_sum_kernel(routed, y, D, TOPK: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    t = i_t.to(tl.int64)
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(routed + (t * TOPK + j) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(y + t * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)


def _offset(shared: torch.Tensor, experts: torch.Tensor) -> int:
    """The shared expert's weights (or scales) as an element offset from the routed experts' base pointer, so that
    one launch reads both (expert id ``E`` means the shared expert) without copying them into one tensor."""
    delta = shared.data_ptr() - experts.data_ptr()
    if shared.dtype != experts.dtype or delta % experts.element_size():
        raise ValueError("fused_moe: shared and routed expert weights must share a dtype and alignment")
    return delta // experts.element_size()


def _experts(x, w13, w2, shared13, shared2, topk_w, topk_ids, limit, out, scales, x_codes, aligned):
    """Grouped GEMMs over each token's routed pairs (``topk_ids`` / ``topk_w`` [T, k]) and its shared pair
    (expert ``E``, weight 1): weighted pair outputs to ``out`` [T (k + 1), D]. ``aligned``: the pairs already
    aligned (``moe_route.route_align_launch``), used where laid out for these GEMMs' block rows."""
    T, k = topk_ids.shape
    k += 1  # pairs per token
    E, N2, K = w13.shape
    N = N2 // 2
    fmt = weight_format(w13)
    cfg = moe_tiles(T * k, E + 1, 1 if fmt != "float" else x.element_size())
    BM, BK = cfg["BM"], cfg["BK"]
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if aligned is not None and aligned.block_rows == BM:
        sorted_ids, expert_ids, used = aligned.sorted_ids, aligned.expert_ids, aligned.used
    else:
        sorted_ids, expert_ids, used = moe_align(topk_ids, E, BM)
    ieee = x.dtype == torch.float32 and fmt == "float"
    if fmt == "float":  # no scales: the weights stand in for the unused scale pointers
        a, sa, (sw13, sw2), soff13, soff2 = x, x, (w13, w2), 0, 0
    else:
        a, sa = quant_act(fmt, x) if x_codes is None else x_codes
        sw13, sw2, ss13, ss2 = scales
        soff13, soff2 = _offset(ss13, sw13), _offset(ss2, sw2)
    h = torch.empty(T * k, N, dtype=x.dtype, device=x.device)
    grid1 = (sorted_ids.numel() // BM * cdiv(N, cfg["BN1"]),)
    # the scales' arguments go last, so that the float specialisation keeps its parameter layout (and machine code)
    fast(moe_gemm1_kernel)[grid1](
        a, w13, h, sorted_ids, expert_ids, used, a.stride(0), w13.stride(0), _offset(shared13, w13), T * k,
        float(limit), sa, sw13, sw13.stride(0), soff13, E=E, N=N, K=K, TOPK=k, BM=BM, BN=cfg["BN1"], BK=BK,
        IEEE=ieee, WEIGHTS=fmt, **launch)
    hq, sh = (h, h) if fmt == "float" else quant_act(fmt, h)
    D = w2.shape[1]
    grid2 = (sorted_ids.numel() // BM * cdiv(D, cfg["BN2"]),)
    fast(moe_gemm2_kernel)[grid2](hq, w2, out, topk_w, sorted_ids, expert_ids, used, w2.stride(0), _offset(shared2, w2),
                                  T * k, sh, sw2, sw2.stride(0), soff2, E=E, N=D, K=N, TOPK=k, BM=BM, BN=cfg["BN2"],
                                  BK=BK, IEEE=ieee, WEIGHTS=fmt, **launch)


def weight_format(w: torch.Tensor) -> str:
    """``"float"``, ``"int8"`` (W8A8, per-channel scales) or ``"fp8"`` (128 x 128 block scales) from the dtype."""
    return WEIGHT_FORMATS.get(w.dtype, "float")


def _scale_shapes(fmt: str, E: int, N2: int, D: int) -> list[tuple]:
    """The scales' shapes of routed w13, routed w2, shared w13, shared w2 in an 8-bit format."""
    if fmt == "int8":
        return [(E, N2), (E, D), (N2,), (D,)]
    g13, g2 = (cdiv(N2, GROUP), cdiv(D, GROUP)), (cdiv(D, GROUP), cdiv(N2 // 2, GROUP))
    return [(E, *g13), (E, *g2), g13, g2]


def _check(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2, scales):
    T, D = x.shape
    E, N2, K = w13.shape
    if K != D or N2 % 2 or w2.shape != (E, D, N2 // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        raise ValueError(f"fused_moe: topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} "
                         f"do not fit {T} tokens")
    if shared_w13.dim() != 2 or shared_w13.shape[1] != D or shared_w2.shape != (D, shared_w13.shape[0] // 2):
        raise ValueError(f"fused_moe: shared expert {tuple(shared_w13.shape)} / {tuple(shared_w2.shape)} does "
                         f"not fit width {D}")
    if not (w13.is_contiguous() and w2.is_contiguous() and shared_w13.is_contiguous() and shared_w2.is_contiguous()):
        raise ValueError("fused_moe: expert weights must be contiguous")
    fmt = weight_format(w13)
    if (fmt == "float") != (scales is None):
        raise ValueError(f"fused_moe: {w13.dtype} experts {'need' if fmt != 'float' else 'take no'} scales")
    if fmt != "float":
        if shared_w13.shape != w13.shape[1:]:
            raise ValueError(f"fused_moe: an 8-bit shared expert must have the routed shape {tuple(w13.shape[1:])}")
        got = [tuple(s.shape) for s in scales]
        if got != _scale_shapes(fmt, E, N2, D) or any(s.dtype != torch.float32 or not s.is_contiguous()
                                                       for s in scales):
            raise ValueError(f"fused_moe: {fmt} scales {got} do not fit w13 {tuple(w13.shape)} (contiguous float32 "
                             f"{_scale_shapes(fmt, E, N2, D)})")


def _no_shared(w13, w2, scales=None):
    """A zero shared expert of the routed shape and format (for the case where the real one is wider or
    runs apart): its weights, and the scales with its zero scales."""
    if scales is None:
        return torch.zeros_like(w13[0]), torch.zeros_like(w2[0]), None
    return (torch.zeros_like(w13[0]), torch.zeros_like(w2[0]),
            (scales[0], scales[1], torch.zeros_like(scales[0][0]), torch.zeros_like(scales[1][0])))


def fused_moe_launch(x, w13, w2, topk_weights, topk_ids, limit: float, shared_w13, shared_w2, scales=None,
                     x_codes=None, aligned=None):
    """Routed experts plus the shared expert: ``fused_moe_ref(...)`` in one pass of fused kernels. Float weights,
    or 8-bit ones (int8 or e4m3) with ``scales`` = (routed w13, routed w2, shared w13, shared w2) scales; a
    shared expert of ``None`` is none. ``x_codes``: int8 weights only, x's per-token codes and scales as
    ``quant_act`` forms them, made by x's producer. ``aligned``: ``moe_route.route_align_launch``'s alignment of
    the pairs."""
    if shared_w13 is None:
        shared_w13, shared_w2, scales = _no_shared(w13, w2, scales)
    _check(x, w13, w2, topk_weights, topk_ids, shared_w13, shared_w2, scales)
    if x_codes is not None and (weight_format(w13) != "int8" or x_codes[0].shape != x.shape
                                or x_codes[1].shape != x.shape[:1]):
        raise ValueError(f"fused_moe: x's codes fit int8 experts and x {tuple(x.shape)} only")
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, D = x.shape
    k = topk_ids.shape[1]
    y = torch.empty_like(x)
    if T == 0:
        return y
    if shared_w13.shape != w13.shape[1:] or shared_w2.shape != w2.shape[1:]:  # a wider shared expert: on its own
        shared = linear(clamped_swiglu(linear(x, shared_w13), limit), shared_w2)
        return fused_moe_launch(x, w13, w2, topk_weights, topk_ids, limit, *_no_shared(w13, w2)[:2],
                                aligned=aligned) + shared
    # every token's k routed pairs plus one pair with the shared expert (id E, weight 1); the pair outputs in the
    # activation dtype: the reference rounds each weighted expert output there too
    pairs = torch.empty(T * (k + 1), D, dtype=x.dtype, device=x.device)
    pair_w, ids = topk_weights.float().contiguous(), topk_ids.to(torch.int32).contiguous()
    _experts(x, w13, w2, shared_w13, shared_w2, pair_w, ids, limit, pairs, scales, x_codes, aligned)
    BD = min(1024, next_power_of_2(D))
    fast(moe_sum_kernel)[(T, cdiv(D, BD))](pairs, y, D, TOPK=k + 1, BD=BD, num_warps=4)
    return y


def fused_moe(x, w13, w2, topk_weights, topk_ids, limit: float, shared_w13, shared_w2, scales=None, x_codes=None,
              aligned=None):
    if use_triton(x, w13, w2, topk_weights, topk_ids):
        return fused_moe_launch(x, w13, w2, topk_weights, topk_ids, limit, shared_w13, shared_w2, scales, x_codes,
                                aligned)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, limit, shared_w13, shared_w2, scales, x_codes)
