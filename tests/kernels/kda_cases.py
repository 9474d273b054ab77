"""Correctness cases for the KDA and conv kernels, shared by the interpreter run (CPU, small sizes) and
the GPU run (real sizes): each compares a Triton launcher with its reference computed in float64 on fresh
random inputs, with the outputs poisoned (NaN) before the run, state slots outside the batch checked
untouched, and variable-length batches checked against a per-sequence loop."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from flashinfra.feedback.registry import compare
from flashinfra.kernels import causal_conv1d as conv
from flashinfra.kernels import kda_decode as dec
from flashinfra.kernels import kda_layer_decode as layer
from flashinfra.kernels import kda_prefill as pre

NAN = float("nan")


def assert_close(name, out, ref, rel: float, atol: float, rtol: float):
    r = compare(name, out, ref, atol=atol, rtol=rtol)
    assert r.passed and r.rel_norm <= rel, f"{r.summary()} (rel_norm limit {rel:g})"


def tolerances(dtype: torch.dtype, device: str) -> tuple[float, float, float]:
    """(rel_norm, atol, rtol) for an output in ``dtype``: interpreter dots are fp32, GPU in-chunk dots tf32."""
    if dtype == torch.bfloat16:
        return 8e-3, 2e-2, 2e-2
    return (2e-5, 1e-5, 1e-4) if device == "cpu" else (2e-3, 5e-3, 5e-3)


def _cu(lens):
    return [0] + list(itertools.accumulate(lens))


def _d(t):
    return t.double() if t.is_floating_point() else t


def prefill_varlen(device: str, lens: list[int], H: int, K: int, V: int, dtype=torch.float32, gated=False,
                   lower_bound=-5.0, seed=0, decay=5.0, row_pad=0, **launch):
    """``decay`` scales the log-decay (the gate's rate when gated): small values keep a long memory, so that
    products between distant tokens of a chunk matter to the result. ``row_pad``: q, k and v as views of rows
    that many elements longer (a row stride other than H * D)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N = sum(lens), len(lens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k, v = (rnd(T, H * D + row_pad)[:, :H * D].unflatten(1, (H, D)) for D in (K, K, V))
    num_slots = N + 2
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:N].tolist()
    init = [bool(i % 2) for i in range(N)]
    state = rnd(num_slots, H, K, V, dt=torch.float32)
    for s, i in zip(slots, init):
        if not i:
            state[s] = NAN  # a fresh sequence must ignore its slot's content
    before = state.clone()
    if gated:
        g_in, b_in = rnd(T, H, K), rnd(T, H)
        A_log, dt_bias = rnd(H, dt=torch.float32) * 0.3 + math.log(decay / 5.0), rnd(H * K, dt=torch.float32)
    else:
        g_in = (-decay * torch.sigmoid(rnd(T, H, K, dt=torch.float32))).float()
        b_in = torch.rand(T, H, device=device, generator=gen)
    out = torch.full((T, H, V), NAN, dtype=dtype, device=device)
    if gated:
        pre.kda_prefill_gated_launch(q, k, v, g_in, b_in, A_log, dt_bias, lower_bound, state, _cu(lens), slots, init,
                                     out=out, **launch)
    else:
        pre.kda_prefill_launch(q, k, v, g_in, b_in, state, _cu(lens), slots, init, out=out, **launch)
    rel, atol, rtol = tolerances(dtype, device)
    state_tol = (2e-5, 1e-4, 1e-3) if device == "cpu" else (2e-3, 2e-3, 2e-3)
    v3 = launch.get("version", pre.default_version(q.dtype, K, V)) == "v3"
    if v3 and device == "cpu":
        # bf16 hi + lo pairs keep about 16 bits (the interpreter rounds to bf16 by truncation)
        rel, atol, rtol = max(rel, 1e-4), max(atol, 1e-4), max(rtol, 1e-3)
        state_tol = (1e-4, 2e-4, 2e-3)
    if v3 and launch.get("chain_precision", pre.V3_CHAIN) == "bf16x2":
        # w and kd rounded once to bf16 (8 bits; truncated by the interpreter): an input rounding
        rel, atol, rtol = max(rel, 4e-3), max(atol, 1e-2), max(rtol, 1e-2)
        state_tol = (5e-3, 1e-2, 1e-2)
    cu = _cu(lens)
    for n, (s, i) in enumerate(zip(slots, init)):  # the per-sequence loop, in float64
        sl = slice(cu[n], cu[n + 1])
        s64 = before[s : s + 1].double().clone()
        args = [_d(x[sl]) for x in (q, k, v, g_in, b_in)]
        if gated:
            ref = pre.kda_prefill_gated_ref(*args, _d(A_log), _d(dt_bias), lower_bound, s64, [0, lens[n]], [0], [i])
        else:
            ref = pre.kda_prefill_ref(*args, s64, [0, lens[n]], [0], [i])
        assert_close(f"o[seq {n}]", out[sl], ref, rel, atol, rtol)
        assert_close(f"state[seq {n}]", state[s], s64[0], *state_tol)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(state[untouched], before[untouched]), "a state slot outside the batch changed"


def _gate_inputs(gen, device: str, T: int, H: int, K: int, gated: bool, lower_bound, decay: float, g_raw=None):
    """The gate pass's inputs and their float64 values: gated, ``g_raw`` (given) with random A_log, dt_bias and
    beta logits, the log-decay ``kda_gate_ref``'s; plain, a log-decay in (-decay, 0) and beta in (0, 1). Returns
    (g_in, b_in, A_log, dt_bias, g64 clamped at -10 per token as the kernels clamp it, b64)."""
    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    if gated:
        b_in, A_log, dt_bias = rnd(T, H), rnd(H) * 0.3 + math.log(decay / 5.0), rnd(H * K)
        x, rate = _d(g_raw) + _d(dt_bias).view(1, H, K), _d(A_log).exp().view(1, H, 1)
        g64 = lower_bound * torch.sigmoid(rate * x) if lower_bound is not None else -rate * F.softplus(x)
        return g_raw, b_in, A_log, dt_bias, g64.clamp(min=-10.0), torch.sigmoid(_d(b_in))
    g_in = (-decay * torch.sigmoid(rnd(T, H, K))).float()
    b_in = torch.rand(T, H, device=device, generator=gen)
    return g_in, b_in, g_in, g_in, _d(g_in).clamp(min=-10.0), _d(b_in)


def _gate_pass(g_in, b_in, A_log, dt_bias, lower_bound, cu, idx, nch: int, H: int, K: int, gated: bool, BK=64,
               num_warps=2):
    """v3's gate pass (kda_prefill_gate.py; by default in the launcher's shape, ``BK`` columns at most per
    program) into scratch poisoned with NaN, every element of which it must write; returns the cumulative
    log-decay [chunks, H, 64, K] and beta [chunks, H, 64]."""
    from flashinfra.kernels.kda_prefill_gate import kda_gate_pass_kernel

    dev = g_in.device
    BK = min(BK, K)
    gc = torch.full((nch, H, 64, K), NAN, dtype=torch.float32, device=dev)
    bc = torch.full((nch, H, 64), NAN, dtype=torch.float32, device=dev)
    kda_gate_pass_kernel[(nch * (K // BK), H)](
        g_in, b_in, A_log, dt_bias, float(lower_bound or 0.0), torch.tensor(cu, dtype=torch.int32, device=dev), idx,
        gc, bc, g_in.stride(0), b_in.stride(0), H=H, K=K, BK=BK, num_warps=num_warps, GATE_IN_KERNEL=gated,
        HAS_LOWER_BOUND=gated and lower_bound is not None, BETA_LOGITS=gated)
    assert not torch.isnan(gc).any() and not torch.isnan(bc).any(), "the gate pass left scratch unwritten"
    return gc, bc


def gate_scratch(device: str, lens: list[int], H: int, K: int, gated=False, lower_bound=-5.0, decay=5.0, seed=0,
                 g_dtype=torch.float32, **launch):
    """v3's gate pass alone against float64: per chunk and head the log-decay (the gated op's from a raw
    projection given as a column slice, with or without its bound), clamped at -10 per token and summed from
    the chunk's first row, rows past the sequence's end repeating its last token's sum, and beta (its sigmoid
    when gated; zero past the end)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, cu = sum(lens), _cu(lens)

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    g_raw = rnd(T, H * K + 8, dt=g_dtype)[:, : H * K].view(T, H, K) if gated else None
    g_in, b_in, A_log, dt_bias, g64, b64 = _gate_inputs(gen, device, T, H, K, gated, lower_bound, decay, g_raw)
    chunks = [(n, c) for n in range(len(lens)) for c in range(-(-lens[n] // 64))]
    idx = torch.tensor(chunks, dtype=torch.int32, device=device).view(-1)
    nch = len(chunks)
    ref_g = torch.zeros(nch, H, 64, K, dtype=torch.float64, device=device)
    ref_b = torch.zeros(nch, H, 64, dtype=torch.float64, device=device)
    for i, (n, c) in enumerate(chunks):
        t0, t1 = cu[n] + 64 * c, min(cu[n] + 64 * c + 64, cu[n + 1])
        gc = g64[t0:t1].cumsum(0).transpose(0, 1)  # [H, m, K]
        ref_g[i] = torch.cat([gc, gc[:, -1:].expand(H, 64 - (t1 - t0), K)], 1)
        ref_b[i, :, : t1 - t0] = b64[t0:t1].transpose(0, 1)
    gc, bc = _gate_pass(g_in, b_in, A_log, dt_bias, lower_bound, cu, idx, nch, H, K, gated, **launch)
    assert_close("gate pass: cumulative log-decay", gc, ref_g, 1e-5, 1e-4, 1e-5)
    assert_close("gate pass: beta", bc, ref_b, 1e-6, 1e-6, 1e-5)


def _intra_inputs(device: str, lens: list[int], H: int, K: int, dtype, gated: bool, lower_bound, decay: float,
                  seed: int) -> dict:
    """The in-chunk kernels' inputs, the gate pass's scratch (``_gate_pass``, itself checked to write every
    element, as the launcher runs it first) and the float64 references per chunk-head: [64, 64] ``ref_a`` (Aqk =
    scale q k^T, lower, diagonal included), ``ref_l`` (L = beta k k^T, strictly lower) and ``ref_ai`` ((I + L)^-1),
    decay-weighted with the gate's -10 clamp; rows past a sequence's end hold zeros; [2, 64] ``ref_rn``, the rows'
    norm factors that kernel D writes for A and B (``scale / |q_r|`` and ``1 / |k_r|``, eps inside the root)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, cu = sum(lens), _cu(lens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k = rnd(T, H, K), rnd(T, H, K)
    g_in, b_in, A_log, dt_bias, g64, b64 = _gate_inputs(gen, device, T, H, K, gated, lower_bound, decay,
                                                        rnd(T, H, K) if gated else None)
    chunks = [(n, c) for n in range(len(lens)) for c in range(-(-lens[n] // 64))]
    idx = torch.tensor(chunks, dtype=torch.int32, device=device).view(-1)
    nch = len(chunks)
    qn, kn = pre.l2norm_ref(_d(q)), pre.l2norm_ref(_d(k))
    ref_a = torch.zeros(nch, H, 64, 64, dtype=torch.float64, device=device)
    ref_l = torch.zeros_like(ref_a)
    ref_rn = torch.full((nch, H, 2, 64), 1e3, dtype=torch.float64, device=device)  # 1 / sqrt(eps) on padding rows
    ref_rn[:, :, 0] *= K**-0.5
    for i, (n, c) in enumerate(chunks):
        t0, t1 = cu[n] + 64 * c, min(cu[n] + 64 * c + 64, cu[n + 1])
        m = t1 - t0
        gc = g64[t0:t1].cumsum(0).transpose(0, 1)  # [H, m, K]
        e = torch.exp(gc[:, :, None, :] - gc[:, None, :, :])  # [H, r, c, K], used for r >= c only
        low = torch.ones(m, m, dtype=torch.bool, device=device).tril()
        qh, kh = qn[t0:t1].transpose(0, 1), kn[t0:t1].transpose(0, 1)
        aa = torch.einsum("hrd,hcd,hrcd->hrc", qh, kh, torch.where(low[None, :, :, None], e, 0.0)) * K**-0.5
        ll = torch.einsum("hrd,hcd,hrcd->hrc", kh, kh, torch.where(low[None, :, :, None], e, 0.0))
        ref_a[i, :, :m, :m] = aa
        ref_l[i, :, :m, :m] = (ll * b64[t0:t1].transpose(0, 1)[:, :, None]).tril(-1)
        for j, (x, f) in enumerate(((q, K**-0.5), (k, 1.0))):
            ref_rn[i, :, j, :m] = f / torch.sqrt((_d(x[t0:t1]) ** 2).sum(-1) + 1e-6).transpose(0, 1)
    eye = torch.eye(64, dtype=torch.float64, device=device)
    gc, bc = _gate_pass(g_in, b_in, A_log, dt_bias, lower_bound, cu, idx, nch, H, K, gated)
    return dict(q=q, k=k, gc=gc, bc=bc, cu_t=torch.tensor(cu, dtype=torch.int32, device=device), idx=idx, nch=nch,
                ref_a=ref_a, ref_l=ref_l, ref_ai=torch.linalg.inv(eye + ref_l), ref_rn=ref_rn)


def _blocks(device: str):
    """Masks of a [64, 64] chunk matrix's 16 x 16 blocks: strictly below, on and strictly above the diagonal."""
    blk = torch.arange(64, device=device) // 16
    return blk[:, None] > blk[None, :], blk[:, None] == blk[None, :], blk[:, None] < blk[None, :]


def _matrix_tolerances(precision: str) -> tuple[float, float, float]:
    """(rel, atol, rtol) of an in-chunk matrix whose products run in ``precision`` (bf16x3: kernel A's merge in
    three bf16 products, about 16 bits of each operand; 0.9-1.8e-5 relative on the interpreter's cases)."""
    return {"ieee": (2e-5, 1e-5, 1e-4), "bf16x3": (1e-4, 5e-5, 5e-4)}.get(precision, (2e-3, 2e-3, 5e-3))


def _ai_tolerances(precision: str, bf16x3: bool) -> tuple[float, float, float]:
    """Ai's tolerances when part of it comes from three-bf16 products: the looser of those and ``precision``'s
    (looser than ieee products, tighter than tf32)."""
    return _matrix_tolerances("bf16x3" if bf16x3 and precision == "ieee" else precision)


def _aqk_tolerances(precision: str, a_lo: bool) -> tuple[float, float, float]:
    """Aqk's hi + lo pair at the products' precision, or its hi half alone at a bf16 rounding's."""
    return _matrix_tolerances(precision) if a_lo else (4e-3, 4e-3, 8e-3)


def intra_d(device: str, lens: list[int], H: int, K: int, dtype=torch.float32, gated=False, lower_bound=-5.0,
            decay=5.0, seed=0, KS=32, num_warps=2, precision="ieee", a_lo=True):
    """v3's kernel D alone (per 16-token sub-block, kda_prefill_intra64_split.py) against float64: the diagonal
    blocks of ``Aqk`` (bf16; with ``a_lo`` its lo half too: hi + lo is compared, else hi at a bf16 rounding's
    tolerance) and of ``Ai``, Aqk's zeros above its diagonal blocks, which the state pass multiplies by, and the
    rows' norm factors that kernels A and B read. Every output starts as NaN: Aqk's and Ai's blocks below the
    diagonal (kernel A's) must keep it, every other element of Aqk and of the norm factors must be written, Ai's
    diagonal blocks too."""
    from flashinfra.kernels.kda_prefill_intra64_split import kda_intra64_diag_kernel

    x = _intra_inputs(device, lens, H, K, dtype, gated, lower_bound, decay, seed)
    nch = x["nch"]
    below, diag, above = _blocks(device)
    aqk = torch.full((nch, H, 1 + a_lo, 64, 64), NAN, dtype=torch.bfloat16, device=device)
    ai = torch.full((nch, H, 64, 64), NAN, dtype=torch.float32, device=device)
    rn = torch.full((nch, H, 2, 64), NAN, dtype=torch.float32, device=device)
    kda_intra64_diag_kernel[(nch * 4, H)](
        x["q"], x["k"], x["gc"], x["bc"], x["cu_t"], x["idx"], aqk, ai, rn, x["q"].stride(0), x["k"].stride(0),
        K**-0.5, H=H, K=K, KS=KS, LOCAL_PRECISION=precision, A_LO=a_lo, FAST_EXP=device != "cpu",
        num_warps=num_warps, num_stages=1)
    assert_close("kernel D: row norm factors", rn, x["ref_rn"], 1e-6, 1e-6, 1e-5)
    rel, atol, rtol = _matrix_tolerances(precision)
    assert torch.isnan(aqk.float()[..., below]).all(), "kernel D wrote into Aqk's blocks below the diagonal"
    assert torch.isnan(ai[..., ~diag]).all(), "kernel D wrote into Ai outside its diagonal blocks"
    assert torch.equal(aqk.float()[..., above], torch.zeros_like(aqk.float()[..., above])), (
        "kernel D left Aqk's blocks above the diagonal other than zero")
    got_a = aqk.float().sum(2) if a_lo else aqk[:, :, 0].float()
    assert_close("Aqk diagonal blocks", got_a[..., diag], x["ref_a"][..., diag], *_aqk_tolerances(precision, a_lo))
    assert_close("Ai diagonal blocks", ai[..., diag], x["ref_ai"][..., diag], rel, atol, rtol)


def intra_a(device: str, lens: list[int], H: int, K: int, dtype=torch.float32, gated=False, lower_bound=-5.0,
            decay=5.0, seed=0, KS=16, num_warps=1, precision="ieee", a_lo=True, solve=None, stages=3):
    """v3's kernel A alone (per 16-row block, kda_prefill_intra64_rows.py) against float64: the off-diagonal
    blocks of ``Aqk`` (bf16, compared as in ``intra_d``) and ``Ai = (I + L)^-1``'s off-diagonal blocks merged
    from diagonal inverses planted as kernel D would write them (products in ``precision``, the merge's in
    ``solve``: by default bf16x3 unless ieee, as the launcher does). Both scratch matrices start as NaN: the blocks A must not write
    (Aqk's and Ai's diagonal blocks, Ai's upper blocks) must keep the poison or the planted values, every
    other element must be written; rows past a sequence's end hold zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashinfra.kernels.kda_prefill_intra64_rows import kda_intra64_offdiag_rows_kernel
    from flashinfra.kernels.kda_prefill_v3 import rows_descriptor

    x = _intra_inputs(device, lens, H, K, dtype, gated, lower_bound, decay, seed)
    nch = x["nch"]
    below, diag, _ = _blocks(device)
    aqk = torch.full((nch, H, 1 + a_lo, 64, 64), NAN, dtype=torch.bfloat16, device=device)
    ai = torch.where(diag, x["ref_ai"], NAN).float()
    planted = ai.clone()
    solve = solve or ("ieee" if precision == "ieee" else "bf16x3")  # the launcher's merge precision by default
    tiles = [rows_descriptor(x["q"], [16, KS]), rows_descriptor(x["k"], [16, KS]),
             TensorDescriptor.from_tensor(x["gc"].view(-1, K), [16, KS])]
    kda_intra64_offdiag_rows_kernel[(nch, H)](
        x["bc"], x["cu_t"], x["idx"], aqk, ai, x["ref_rn"].float(), *tiles, H=H, K=K, KS=KS, LOCAL_PRECISION=precision,
        SOLVE_PRECISION=solve, FAST_EXP=device != "cpu", A_LO=a_lo, DOT_F32=device == "cpu", STAGES=stages,
        num_warps=num_warps)
    rel, atol, rtol = _ai_tolerances(precision, solve == "bf16x3")
    assert torch.isnan(aqk.float()[..., ~below]).all(), "kernel A wrote into Aqk's diagonal or upper blocks"
    untouched = torch.nan_to_num(ai[..., ~below], 7.0), torch.nan_to_num(planted[..., ~below], 7.0)
    assert torch.equal(*untouched), "kernel A wrote into Ai's diagonal or upper blocks"
    got_a = aqk.float().sum(2) if a_lo else aqk[:, :, 0].float()
    assert_close("Aqk lower blocks", got_a[..., below], x["ref_a"][..., below], *_aqk_tolerances(precision, a_lo))
    assert_close("Ai lower blocks", ai[..., below], x["ref_ai"][..., below], rel, atol, rtol)


def decode(device: str, B: int, H: int, K: int, V: int, dtype=torch.float32, seed=0, state_dtype=torch.float32,
           **launch):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k, v = rnd(B, H, K), rnd(B, H, K), rnd(B, H, V)
    g = (-5 * torch.sigmoid(rnd(B, H, K, dt=torch.float32))).float()
    beta = torch.rand(B, H, device=device, generator=gen)
    state = rnd(B + 3, H, K, V, dt=state_dtype)
    slots = torch.randperm(B + 3, device=device, generator=gen)[:B]
    s64 = state.double().clone()
    before = state.clone()
    ref = dec.kda_decode_ref(_d(q), _d(k), _d(v), _d(g), _d(beta), s64, slots)
    out = torch.full((B, H, V), NAN, dtype=dtype, device=device)
    dec.kda_decode_launch(q, k, v, g, beta, state, slots, out=out, **launch)
    rel, atol, rtol = tolerances(dtype, device)
    assert_close("o", out, ref, rel, atol, rtol)
    if state_dtype == torch.float32:
        assert_close("state", state, s64, 1e-6, 1e-5, 1e-4)
    else:  # the new state rounded once to bf16
        assert_close("state", state, s64, 4e-3, 1e-2, 1e-2)
    others = [s for s in range(B + 3) if s not in slots.tolist()]
    assert torch.equal(state[others], before[others]), "slots outside the batch changed"


def layer_decode_inputs(device: str, B: int, H: int, K: int, state_dtype=torch.float32, dtype=torch.float32,
                        lower_bound=-5.0, seed=0, W=4) -> dict:
    """Arguments of ``kda_layer_decode_launch`` (K = V), two slots more than the batch uses."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C = 3 * H * K

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dt)

    return dict(qkv=rnd(B, C + 7)[:, :C], conv_weight=rnd(C, W, dt=torch.float32, scale=0.5),
                conv_state=rnd(B + 2, C, W - 1), g_raw=rnd(B, H * K), beta_logits=rnd(B, H), gate=rnd(B, H * K),
                A_log=rnd(H, dt=torch.float32, scale=0.3), dt_bias=rnd(H * K, dt=torch.float32),
                lower_bound=lower_bound, norm_weight=rnd(K), eps=1e-5, state=rnd(B + 2, H, K, K, dt=state_dtype),
                state_slots=torch.randperm(B + 2, device=device, generator=gen)[:B])


def layer_decode(device: str, B: int, H: int, K: int, state_dtype=torch.float32, dtype=torch.float32,
                 lower_bound=-5.0, seed=0, W=4, **launch):
    a = layer_decode_inputs(device, B, H, K, state_dtype, dtype, lower_bound, seed, W)
    r = {n: (t.double().clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in a.items()}
    ref = layer.kda_layer_decode_ref(**r)
    conv_before, state_before = a["conv_state"].clone(), a["state"].clone()
    out = torch.full((B, H, K), NAN, dtype=dtype, device=device)
    layer.kda_layer_decode_launch(**a, out=out, **launch)
    rel, atol, rtol = tolerances(dtype, device)
    assert_close("o", out, ref, rel, atol, rtol)
    if state_dtype == torch.float32 and dtype == torch.float32:
        assert_close("state", a["state"], r["state"], 1e-6, 1e-5, 1e-4)
    else:  # one bf16 rounding of the new state, or of the conv output that feeds it
        assert_close("state", a["state"], r["state"], 4e-3, 1e-2, 1e-2)
    assert torch.equal(a["conv_state"].double(), r["conv_state"]), "conv state differs from the reference shift"
    others = [s for s in range(B + 2) if s not in a["state_slots"].tolist()]
    assert torch.equal(a["state"][others], state_before[others]) and torch.equal(a["conv_state"][others],
                                                                                  conv_before[others])


def conv_prefill(device: str, lens: list[int], C: int, W: int = 4, dtype=torch.float32, seed=0, **launch):
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N = sum(lens), len(lens)
    x = torch.randn(T, C + 5, device=device, generator=gen).to(dtype)[:, :C]  # a column slice, as in the model
    w = torch.randn(C, W, device=device, generator=gen)
    cs = torch.randn(N + 2, C, W - 1, device=device, generator=gen).to(dtype)
    slots = torch.randperm(N + 2, generator=torch.Generator().manual_seed(seed))[:N].tolist()
    init = [bool((i + 1) % 2) for i in range(N)]
    before = cs.clone()
    out = torch.full((T, C), NAN, dtype=dtype, device=device)
    conv.causal_conv1d_prefill_launch(x, w, cs, _cu(lens), slots, init, out=out, **launch)
    cs64 = before.double().clone()
    ref = conv.causal_conv1d_prefill_ref(_d(x), _d(w), cs64, _cu(lens), slots, init)
    rel, atol, rtol = tolerances(dtype, "cpu")
    assert_close("y", out, ref, rel, atol, rtol)
    assert torch.equal(cs.double(), cs64), "conv state must match the reference bit for bit"


def conv_decode(device: str, B: int, C: int, W: int = 4, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, C, device=device, generator=gen).to(dtype)
    w = torch.randn(C, W, device=device, generator=gen)
    cs = torch.randn(B + 2, C, W - 1, device=device, generator=gen).to(dtype)
    slots = torch.randperm(B + 2, device=device, generator=gen)[:B]
    cs64 = cs.double().clone()
    ref = conv.causal_conv1d_decode_ref(_d(x), _d(w), cs64, slots)
    out = torch.full((B, C), NAN, dtype=dtype, device=device)
    conv.causal_conv1d_decode_launch(x, w, cs, slots, out=out)
    rel, atol, rtol = tolerances(dtype, "cpu")
    assert_close("y", out, ref, rel, atol, rtol)
    assert torch.equal(cs.double(), cs64), "conv state must match the reference bit for bit"


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` then decode ``steps`` tokens greedily, one sequence, through the model's forward."""
    from flashinfra.model.forward_batch import ForwardBatch

    bs, dev = 16, model.device
    table = list(range((len(prompt) + steps + bs - 1) // bs))
    cache = model.allocate_cache(len(table), bs, 2)
    batch = ForwardBatch.build([len(prompt)], [0], [1], [table], bs, dev)
    hidden = model.forward(torch.tensor(prompt, device=dev), batch, cache)
    logits = [model.compute_logits(hidden[-1:])[0]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        batch = ForwardBatch.build([1], [len(prompt) + i], [1], [table], bs, dev)
        hidden = model.forward(torch.tensor(tokens[-1:], device=dev), batch, cache)
        logits.append(model.compute_logits(hidden)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def tiny_model_greedy_same(tmp_path, monkeypatch, device: str, steps: int = 8):
    """The tiny model's greedy tokens (prefill + decode) are the same with the KDA/conv kernels and with their
    references. Every other op runs its reference in both runs, so only these kernels are compared."""
    from flashinfra.kernels import dispatch
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    mine = (conv, layer, pre)
    calls = {}
    for mod in mine:
        for name in [n for n in vars(mod) if n.endswith("_launch")]:
            def counted(*args, _f=getattr(mod, name), _n=name, **kwargs):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*args, **kwargs)

            monkeypatch.setattr(mod, name, counted)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=1), dtype="float32", device=device)
    prompt = torch.randint(1, model.config.text.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    for mod in mine:
        monkeypatch.setattr(mod, "use_triton", lambda *tensors: True)
    fast, fast_logits = greedy(model, prompt, steps)
    for name in ("kda_prefill_gated_launch", "kda_layer_decode_launch", "causal_conv1d_prefill_launch"):
        assert calls.get(name, 0) > 0, f"{name} never ran: {calls}"
    for mod in mine:
        monkeypatch.setattr(mod, "use_triton", lambda *tensors: False)
    ref, ref_logits = greedy(model, prompt, steps)
    assert fast == ref
    for a, b in zip(fast_logits, ref_logits):
        assert float((a - b).norm() / b.norm()) < 1e-2
