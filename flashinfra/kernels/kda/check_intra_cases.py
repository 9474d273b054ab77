"""Correctness cases of the 64-token prefill's in-chunk kernels alone against float64, each with its scratch
poisoned: the gate pass (prefill_gate.py), the diagonal kernel (the diagonal blocks and their inverses,
prefill_intra_diag.py) and the off-diagonal kernel (the blocks below the diagonal and the merge,
prefill_intra_offdiag.py). Each returns its ``CheckResult``s; the registered checks (checks.py) and the tests
(tests/kernels) run them; the whole prefill's cases are in check_cases.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from flashinfra.feedback.registry import CheckResult
from flashinfra.kernels.kda import ref as kda_ref
from flashinfra.kernels.kda.check_cases import NAN, close, f64, offsets


def _gate_inputs(gen, device: str, T: int, H: int, K: int, gated: bool, lower_bound, decay: float, g_raw=None):
    """The gate pass's inputs and their float64 values: gated, ``g_raw`` (given) with random A_log, dt_bias and
    beta logits, the log-decay ``kda_gate_ref``'s; plain, a log-decay in (-decay, 0) and beta in (0, 1). Returns
    (g_in, b_in, A_log, dt_bias, g64 clamped at -10 per token as the kernels clamp it, b64)."""
    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    if gated:
        b_in, A_log, dt_bias = rnd(T, H), rnd(H) * 0.3 + math.log(decay / 5.0), rnd(H * K)
        x, rate = f64(g_raw) + f64(dt_bias).view(1, H, K), f64(A_log).exp().view(1, H, 1)
        g64 = lower_bound * torch.sigmoid(rate * x) if lower_bound is not None else -rate * F.softplus(x)
        return g_raw, b_in, A_log, dt_bias, g64.clamp(min=-10.0), torch.sigmoid(f64(b_in))
    g_in = (-decay * torch.sigmoid(rnd(T, H, K))).float()
    b_in = torch.rand(T, H, device=device, generator=gen)
    return g_in, b_in, g_in, g_in, f64(g_in).clamp(min=-10.0), f64(b_in)


def _gate_pass(g_in, b_in, A_log, dt_bias, lower_bound, cu, idx, nch: int, H: int, K: int, gated: bool, BK=64,
               num_warps=2):
    """The gate pass (prefill_gate.py; by default in the launcher's shape, ``BK`` columns at most per
    program) into scratch poisoned with NaN, every element of which it must write; returns the cumulative
    log-decay [chunks, H, 64, K] and beta [chunks, H, 64]."""
    from flashinfra.kernels.kda.prefill_gate import kda_gate_pass_kernel

    dev = g_in.device
    BK = min(BK, K)
    gc = torch.full((nch, H, 64, K), NAN, dtype=torch.float32, device=dev)
    bc = torch.full((nch, H, 64), NAN, dtype=torch.float32, device=dev)
    kda_gate_pass_kernel[(nch * (K // BK), H)](
        g_in, b_in, A_log, dt_bias, float(lower_bound or 0.0), torch.tensor(cu, dtype=torch.int32, device=dev), idx,
        gc, bc, g_in.stride(0), b_in.stride(0), H=H, K=K, BK=BK, num_warps=num_warps, GATE_IN_KERNEL=gated,
        HAS_LOWER_BOUND=gated and lower_bound is not None, BETA_LOGITS=gated)
    return gc, bc


def holds(name: str, ok) -> CheckResult:
    """A condition as a result (``name`` says what must hold)."""
    return CheckResult(name=name, passed=bool(ok), message="" if ok else "does not hold")


def gate_scratch(device: str, lens: list[int], H: int, K: int, gated=False, lower_bound=-5.0, decay=5.0, seed=0,
                 g_dtype=torch.float32, **launch):
    """The gate pass alone against float64: per chunk and head the log-decay (the gated op's from a raw
    projection given as a column slice, with or without its bound), clamped at -10 per token and summed from
    the chunk's first row, rows past the sequence's end repeating its last token's sum, and beta (its sigmoid
    when gated; zero past the end)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, cu = sum(lens), offsets(lens)

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
    return [holds("gate pass: every scratch element written", not gc.isnan().any() and not bc.isnan().any()),
            close("gate pass: cumulative log-decay", gc, ref_g, 1e-5, 1e-4, 1e-5),
            close("gate pass: beta", bc, ref_b, 1e-6, 1e-6, 1e-5)]


def _intra_inputs(device: str, lens: list[int], H: int, K: int, dtype, gated: bool, lower_bound, decay: float,
                  seed: int) -> dict:
    """The in-chunk kernels' inputs, the gate pass's scratch (``_gate_pass``, itself checked to write every element, as
    the launcher runs it first) and the float64 references per chunk-head: [64, 64] ``ref_a`` (Aqk = scale q k^T,
    lower, diagonal included), ``ref_l`` (L = beta k k^T, strictly lower) and ``ref_ai`` ((I + L)^-1),
    decay-weighted with the gate's -10 clamp; rows past a sequence's end hold zeros; [2, 64] ``ref_rn``, the rows'
    norm factors that the diagonal kernel writes for the off-diagonal and w/u kernels (``scale / |q_r|`` and ``1 /
    |k_r|``, eps inside the root); [64, K] ``ref_qg`` (``q exp(gc) scale / |q|``), ``ref_kd`` (``k exp(gl - gc) /
    |k|``) and ``ref_kg`` (``k exp(gc) / |k|``), the state pass's tiles, and [K] ``ref_egl`` (``exp(gl)``) per
    chunk-head."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, cu = sum(lens), offsets(lens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k = rnd(T, H, K), rnd(T, H, K)
    g_in, b_in, A_log, dt_bias, g64, b64 = _gate_inputs(gen, device, T, H, K, gated, lower_bound, decay,
                                                        rnd(T, H, K) if gated else None)
    chunks = [(n, c) for n in range(len(lens)) for c in range(-(-lens[n] // 64))]
    idx = torch.tensor(chunks, dtype=torch.int32, device=device).view(-1)
    nch = len(chunks)
    qn, kn = kda_ref.l2norm_ref(f64(q)), kda_ref.l2norm_ref(f64(k))
    ref_a = torch.zeros(nch, H, 64, 64, dtype=torch.float64, device=device)
    ref_l = torch.zeros_like(ref_a)
    ref_rn = torch.full((nch, H, 2, 64), 1e3, dtype=torch.float64, device=device)  # 1 / sqrt(eps) on padding rows
    ref_rn[:, :, 0] *= K**-0.5
    ref_qg = torch.zeros(nch, H, 64, K, dtype=torch.float64, device=device)  # zeros past a sequence's end
    ref_kd, ref_kg = torch.zeros_like(ref_qg), torch.zeros_like(ref_qg)
    ref_egl = torch.zeros(nch, H, K, dtype=torch.float64, device=device)
    for i, (n, c) in enumerate(chunks):
        t0, t1 = cu[n] + 64 * c, min(cu[n] + 64 * c + 64, cu[n + 1])
        m = t1 - t0
        gc = g64[t0:t1].cumsum(0).transpose(0, 1)  # [H, m, K]
        ref_qg[i, :, :m] = qn[t0:t1].transpose(0, 1) * K**-0.5 * gc.exp()
        ref_kd[i, :, :m] = kn[t0:t1].transpose(0, 1) * (gc[:, -1:] - gc).exp()
        ref_kg[i, :, :m] = kn[t0:t1].transpose(0, 1) * gc.exp()
        ref_egl[i] = gc[:, -1].exp()
        e = torch.exp(gc[:, :, None, :] - gc[:, None, :, :])  # [H, r, c, K], used for r >= c only
        low = torch.ones(m, m, dtype=torch.bool, device=device).tril()
        qh, kh = qn[t0:t1].transpose(0, 1), kn[t0:t1].transpose(0, 1)
        aa = torch.einsum("hrd,hcd,hrcd->hrc", qh, kh, torch.where(low[None, :, :, None], e, 0.0)) * K**-0.5
        ll = torch.einsum("hrd,hcd,hrcd->hrc", kh, kh, torch.where(low[None, :, :, None], e, 0.0))
        ref_a[i, :, :m, :m] = aa
        ref_l[i, :, :m, :m] = (ll * b64[t0:t1].transpose(0, 1)[:, :, None]).tril(-1)
        for j, (x, f) in enumerate(((q, K**-0.5), (k, 1.0))):
            ref_rn[i, :, j, :m] = f / torch.sqrt((f64(x[t0:t1]) ** 2).sum(-1) + 1e-6).transpose(0, 1)
    eye = torch.eye(64, dtype=torch.float64, device=device)
    gc, bc = _gate_pass(g_in, b_in, A_log, dt_bias, lower_bound, cu, idx, nch, H, K, gated)
    written = holds("gate pass: every scratch element written", not gc.isnan().any() and not bc.isnan().any())
    return dict(gate_written=written, q=q, k=k, gc=gc, bc=bc, cu_t=torch.tensor(cu, dtype=torch.int32, device=device),
                idx=idx, nch=nch,
                ref_a=ref_a, ref_l=ref_l, ref_ai=torch.linalg.inv(eye + ref_l), ref_rn=ref_rn, ref_qg=ref_qg,
                ref_kd=ref_kd, ref_kg=ref_kg, ref_egl=ref_egl)


def _blocks(device: str):
    """Masks of a [64, 64] chunk matrix's 16 x 16 blocks: strictly below, on and strictly above the diagonal."""
    blk = torch.arange(64, device=device) // 16
    return blk[:, None] > blk[None, :], blk[:, None] == blk[None, :], blk[:, None] < blk[None, :]


def _matrix_tolerances(precision: str) -> tuple[float, float, float]:
    """(rel, atol, rtol) of an in-chunk matrix whose products run in ``precision`` (bf16x3: the off-diagonal kernel's
    merge in three bf16 products, about 16 bits of each operand; 0.9-1.8e-5 relative on the interpreter's cases)."""
    return {"ieee": (2e-5, 1e-5, 1e-4), "bf16x3": (1e-4, 5e-5, 5e-4)}.get(precision, (2e-3, 2e-3, 5e-3))


def _ai_tolerances(precision: str, bf16x3: bool) -> tuple[float, float, float]:
    """Ai's tolerances when part of it comes from three-bf16 products: the looser of those and ``precision``'s
    (looser than ieee products, tighter than tf32)."""
    return _matrix_tolerances("bf16x3" if bf16x3 and precision == "ieee" else precision)


def _aqk_tolerances(precision: str, a_lo: bool) -> tuple[float, float, float]:
    """Aqk's hi + lo pair at the products' precision, or its hi half alone at a bf16 rounding's."""
    return _matrix_tolerances(precision) if a_lo else (4e-3, 4e-3, 8e-3)


def intra_diag(device: str, lens: list[int], H: int, K: int, dtype=torch.float32, gated=False, lower_bound=-5.0,
            decay=5.0, seed=0, KS=32, num_warps=2, precision="ieee", a_lo=True, kg=False):
    """The diagonal kernel alone (per 16-token sub-block, prefill_intra_diag.py) against float64: the diagonal blocks
    of ``Aqk`` (bf16; with ``a_lo`` its lo half too: hi + lo is compared, else hi at a bf16 rounding's tolerance)
    and of ``Ai``, Aqk's zeros above its diagonal blocks, which the state pass multiplies by, and the rows' norm
    factors that the off-diagonal and w/u kernels read; the state pass's qg (bf16) and kd (a bf16 pair) in the
    bf16x3 chain's slots of the w/u kernel's scratch, whose w slots must keep their poison, and ``exp(gl)`` too;
    with ``kg`` (bf16 v) those slots take ``-k exp(gc) / |k|`` (a bf16 pair) and ``exp(gl)`` its [K] row per
    chunk-head instead. Every output starts as NaN: Aqk's and Ai's blocks below the diagonal (the off-diagonal
    kernel's) must keep it, every other element of Aqk and of the norm factors must be written, Ai's diagonal blocks
    too."""
    from flashinfra.kernels.kda.prefill_intra_diag import kda_intra_diag_kernel

    x = _intra_inputs(device, lens, H, K, dtype, gated, lower_bound, decay, seed)
    nch = x["nch"]
    below, diag, above = _blocks(device)
    aqk = torch.full((nch, H, 1 + a_lo, 64, 64), NAN, dtype=torch.bfloat16, device=device)
    ai = torch.full((nch, H, 64, 64), NAN, dtype=torch.float32, device=device)
    rn = torch.full((nch, H, 2, 64), NAN, dtype=torch.float32, device=device)
    wqk = torch.full((nch, H, 5, 64, K), NAN, dtype=torch.bfloat16, device=device)  # w, w lo, qg, kd, kd lo
    egl = torch.full((nch, H, K), NAN, dtype=torch.float32, device=device)
    kda_intra_diag_kernel[(nch * 4, H)](
        x["q"], x["k"], x["gc"], x["bc"], x["cu_t"], x["idx"], aqk, ai, rn, x["q"].stride(0), x["k"].stride(0),
        K**-0.5, wqk, egl, H=H, K=K, KS=KS, LOCAL_PRECISION=precision, A_LO=a_lo, FAST_EXP=device != "cpu",
        NS=5, SQ=2, SKD=3, KD_LO=True, KG=kg, W_LO=True, num_warps=num_warps, num_stages=1)
    results = [x["gate_written"], close("row norm factors", rn, x["ref_rn"], 1e-6, 1e-6, 1e-5)]
    if kg:
        results.append(close("-kg pair", wqk[:, :, 0].float() + wqk[:, :, 1].float(), -x["ref_kg"],
                             *_matrix_tolerances("bf16x3")))
        # gl is the gate pass's float32 sum over up to 64 rows: exp(gl) relative to float64's within 1e-3 where gl
        # is large (|gl| ~ 100)
        results.append(close("exp(gl)", egl, x["ref_egl"], 1e-6, 1e-7, 1e-3))
    else:
        results += [holds("w's slots left unwritten", torch.isnan(wqk[:, :, :2].float()).all()),
                    holds("exp(gl) left unwritten", torch.isnan(egl).all())]
    results += [close("qg", wqk[:, :, 2].float(), x["ref_qg"], 4e-3, 4e-3, 8e-3),
                close("kd pair", wqk[:, :, 3].float() + wqk[:, :, 4].float(), x["ref_kd"],
                      *_matrix_tolerances("bf16x3"))]
    rel, atol, rtol = _matrix_tolerances(precision)
    got_a = aqk.float().sum(2) if a_lo else aqk[:, :, 0].float()
    return results + [
        holds("Aqk's blocks below the diagonal left unwritten", torch.isnan(aqk.float()[..., below]).all()),
        holds("Ai outside its diagonal blocks left unwritten", torch.isnan(ai[..., ~diag]).all()),
        holds("Aqk's blocks above the diagonal zero",
              torch.equal(aqk.float()[..., above], torch.zeros_like(aqk.float()[..., above]))),
        close("Aqk diagonal blocks", got_a[..., diag], x["ref_a"][..., diag], *_aqk_tolerances(precision, a_lo)),
        close("Ai diagonal blocks", ai[..., diag], x["ref_ai"][..., diag], rel, atol, rtol)]


def intra_offdiag(device: str, lens: list[int], H: int, K: int, dtype=torch.float32, gated=False, lower_bound=-5.0,
            decay=5.0, seed=0, KS=16, num_warps=1, precision="ieee", a_lo=True, solve=None, stages=3):
    """The off-diagonal kernel alone (per 16-row block, prefill_intra_offdiag.py) against float64: the off-diagonal
    blocks of ``Aqk`` (bf16, compared as in ``intra_diag``) and ``Ai = (I + L)^-1``'s off-diagonal blocks merged
    from diagonal inverses planted as the diagonal kernel would write them (products in ``precision``, the merge's in
    ``solve``: by default bf16x3 unless ieee, as the launcher does). Both scratch matrices start as NaN: the blocks
    A must not write (Aqk's and Ai's diagonal blocks, Ai's upper blocks) must keep the poison or the planted
    values, every other element must be written; rows past a sequence's end hold zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashinfra.kernels.kda.prefill_intra_offdiag import kda_intra_offdiag_kernel
    from flashinfra.kernels.kda.prefill import rows_descriptor

    x = _intra_inputs(device, lens, H, K, dtype, gated, lower_bound, decay, seed)
    nch = x["nch"]
    below, diag, _ = _blocks(device)
    aqk = torch.full((nch, H, 1 + a_lo, 64, 64), NAN, dtype=torch.bfloat16, device=device)
    ai = torch.where(diag, x["ref_ai"], NAN).float()
    planted = ai.clone()
    solve = solve or ("ieee" if precision == "ieee" else "bf16x3")  # the launcher's merge precision by default
    tiles = [rows_descriptor(x["q"], [16, KS]), rows_descriptor(x["k"], [16, KS]),
             TensorDescriptor.from_tensor(x["gc"].view(-1, K), [16, KS])]
    kda_intra_offdiag_kernel[(nch, H)](
        x["bc"], x["cu_t"], x["idx"], aqk, ai, x["ref_rn"].float(), *tiles, ai, H=H, K=K, KS=KS,
        LOCAL_PRECISION=precision,
        SOLVE_PRECISION=solve, FAST_EXP=device != "cpu", A_LO=a_lo, DOT_F32=device == "cpu", STAGES=stages,
        num_warps=num_warps)
    rel, atol, rtol = _ai_tolerances(precision, solve == "bf16x3")
    untouched = torch.nan_to_num(ai[..., ~below], 7.0), torch.nan_to_num(planted[..., ~below], 7.0)
    got_a = aqk.float().sum(2) if a_lo else aqk[:, :, 0].float()
    return [x["gate_written"],
            holds("Aqk's diagonal and upper blocks left unwritten", torch.isnan(aqk.float()[..., ~below]).all()),
            holds("Ai's diagonal (planted) and upper blocks left as they were", torch.equal(*untouched)),
            close("Aqk lower blocks", got_a[..., below], x["ref_a"][..., below], *_aqk_tolerances(precision, a_lo)),
            close("Ai lower blocks", ai[..., below], x["ref_ai"][..., below], rel, atol, rtol)]
