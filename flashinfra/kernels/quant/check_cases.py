"""Correctness cases of the 8-bit weight paths (activation quantization, the W8A8 and block-FP8 linear, the fused
MoE on those weights), shared by the registered checks (checks.py, fixed sizes) and the tests (tests/kernels: the
interpreter's small odd sizes, the GPU's real ones, through ``assert_passed``). The 8-bit caches' cases are the
float cases' own with a cache format (``flashinfra.kernels.checks``: ``sparse_mla``, ``dsa_select``).

Each case draws fresh random inputs and checks the kernel twice: against the float64 computation of the same
quantized arithmetic (tight: only float32 epilogue rounding and the output dtype separate them), and against the
unquantized float64 computation (loose: the stated quantization error budget). It returns its ``CheckResult``s,
failed ones included, instead of raising. None of these launchers takes an output buffer, so there is none to
poison. Triton's CPU interpreter converts floats to e4m3 wrongly at exponent carries, so under it the fp8
activations are quantized by torch (``torch_fp8_activations``) and fp8 codes are compared allowing for that.
"""

from __future__ import annotations

import contextlib

import torch

from flashinfra.feedback.registry import CheckResult, compare


def rnd(*shape, device, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)


def check(name, out, ref, max_rel_norm=None, **kw) -> CheckResult:
    """``compare``, with a bound on the relative norm of the error too when ``max_rel_norm`` is given."""
    r = compare(name, out, ref, **kw)
    if r.passed and max_rel_norm is not None and r.rel_norm > max_rel_norm:
        r.passed = False
        r.message = f"rel_norm {r.rel_norm:.3g} above {max_rel_norm:g}"
    return r


def holds(name: str, passed: bool, message: str) -> CheckResult:
    """A condition that is not an elementwise comparison (how many codes differ, how many selections) as a result."""
    return CheckResult(name=name, passed=bool(passed), message=message)


def within(name: str, out, full, bound: float, what: str) -> CheckResult:
    """``rel_err(out, full) < bound``: the quantization error against the unquantized float64 computation."""
    err = rel_err(out, full)
    return CheckResult(name=name, passed=err < bound, rel_norm=err, numel=out.numel(), shape=tuple(out.shape),
                       message=f"{err:.4f} from {what} (bound {bound:g})")


def moe_tol(dtype) -> dict:
    """A grouped 8-bit MoE against the float64 computation of its quantized arithmetic: the intermediate is
    quantized again before the down projection, and where its value sits at a rounding tie of that
    quantization (float32 or bf16 against float64) its code moves one step, which the down projection
    spreads over a whole output row. So elements may differ by about one such step while the output as a
    whole stays at the output dtype's rounding (``rel_norm``)."""
    if dtype == torch.float32:
        return dict(atol=5e-3, rtol=5e-3, max_rel_norm=1e-3)
    return dict(atol=6e-2, rtol=6e-2, max_rel_norm=1e-2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Frobenius-norm relative error."""
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# quantization error budgets against the unquantized product (relative Frobenius error, Gaussian data)
INT8_REL = 0.03  # per-token x per-channel int8: ~1 % measured
FP8_REL = 0.08  # e4m3 (3 mantissa bits) on both operands: ~4 % measured


def exact_tol(dtype) -> dict:
    """Kernel against the float64 computation of the same quantized arithmetic."""
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def quant_act(device: str, T: int, K: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """Both activation quantizers against their references: scales, codes (one step apart at a rounding tie at
    most), and the int8 dequantization within half a step of the input."""
    from flashinfra.kernels.quant import act as qa

    gen = torch.Generator(device=device).manual_seed(seed)
    x = rnd(T, K, device=device, gen=gen, dtype=dtype)
    x[0] = 0  # an all-zero row: scale 1, zeros out
    q, s = qa.quant_int8_per_token_launch(x)
    rq, rs = qa.quant_int8_per_token_ref(x)
    res = [check("quant_int8.scales", s, rs, atol=0, rtol=1e-6)]  # amax / 127 (a GPU division may round differently)
    steps = (q.int() - rq.int()).abs()
    tied = float((steps > 0).float().mean())
    res.append(holds("quant_int8.codes", int(steps.max()) <= 1 and tied < 1e-3,
                     f"largest code difference {int(steps.max())}, fraction differing {tied:.2e} (ties: 1, < 1e-3)"))
    res.append(check("quant_int8.dequant", q.double() * s.double()[:, None], x.double(),
                     atol=float(s.max()) * 0.5 + 1e-6, rtol=0))
    q8, s8 = qa.quant_fp8_per_group_launch(x)
    rq8, rs8 = qa.quant_fp8_per_group_ref(x)
    res.append(check("quant_fp8.scales", s8, rs8, atol=0, rtol=1e-6))
    same = q8.view(torch.uint8) == rq8.view(torch.uint8)
    if device == "cpu":
        # Triton 3.x's interpreter converts to e4m3 wrongly where rounding carries into the exponent (124.3 ->
        # 64 instead of 128) and truncates subnormals (by one step of 2^-9); the GPU's conversion is exact, so
        # only there must every code match
        carry = q8.float() * 2 == rq8.float()
        subnormal = (rq8.float().abs() <= 2**-6) & ((q8.float() - rq8.float()).abs() <= 2**-9)
        ok = same | carry | subnormal
        res.append(holds("quant_fp8.codes", bool(ok.all()),
                         f"{int((~ok).sum())} codes differ beyond the interpreter's carry / subnormal rounding"))
    else:  # round to nearest even on both sides: only a scale rounded differently can move a code
        res.append(holds("quant_fp8.codes", float(same.float().mean()) > 0.999,
                         f"fraction of equal codes {float(same.float().mean()):.5f} (bound > 0.999)"))
    return res


@contextlib.contextmanager
def torch_fp8_activations(device: str):
    """On the CPU, e4m3 activations quantized by torch inside the block: the interpreter's e4m3 conversion
    mis-rounds at exponent carries (see ``quant_act``); the GPU's kernel is checked bit for bit there."""
    from flashinfra.kernels.quant import act

    quantize = act.quant_fp8_per_group
    if device == "cpu":
        act.quant_fp8_per_group = act.quant_fp8_per_group_ref
    try:
        yield
    finally:
        act.quant_fp8_per_group = quantize


def _quantizer(scheme: str):
    """The weight quantizer of ``scheme`` and its relative error budget against the unquantized product."""
    from flashinfra.quant.weights import quantize_fp8_blocks, quantize_int8_per_channel

    return (quantize_int8_per_channel, INT8_REL) if scheme == "w8a8" else (quantize_fp8_blocks, FP8_REL)


def linear(device: str, scheme: str, T: int, K: int, N: int, dtype=torch.float32, bias=False,
           seed=0, block_rows: int = 128) -> list[CheckResult]:
    """The 8-bit GEMM on W8A8 (``scheme="w8a8"``) or block-FP8 weights (``block_rows`` x 128 blocks; fewer rows than
    a column tile take the per-column scale path) against float64 of the same codes, and the linear (activation
    quantization included) against the unquantized product."""
    from flashinfra.kernels.quant import gemm
    from flashinfra.kernels.quant.act import quant_act_ref

    quantize, bound = _quantizer(scheme)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = rnd(T, K, device=device, gen=gen, dtype=dtype)
    w = rnd(N, K, device=device, gen=gen, scale=K**-0.5)
    b = rnd(N, device=device, gen=gen) if bias else None
    qw = quantize(w) if scheme == "w8a8" else quantize(w, (block_rows, 128))
    xq, sx = quant_act_ref("int8" if scheme == "w8a8" else "fp8", x)
    out = gemm.matmul_8bit_launch(xq, sx, qw.data, qw.scale, b, qw.block, dtype)
    ref = gemm.matmul_8bit_ref(xq, sx, qw.data, qw.scale, b, qw.block, torch.float64)
    res = [check(f"{scheme}_matmul", out, ref, **exact_tol(dtype))]
    with torch_fp8_activations(device):
        out = gemm.linear_8bit_launch(x, qw.data, qw.scale, b, qw.block)
    full = x.double() @ w.double().t() + (b.double() if bias else 0)
    return res + [within(f"{scheme}_linear.quant_error", out, full, bound, "the unquantized product")]


def moe(device: str, scheme: str, T: int, E: int, D: int, I: int, top_k: int, dtype=torch.float32, limit=10.0,
        seed=0) -> list[CheckResult]:
    """``fused_moe`` on W8A8 (``scheme="w8a8"``) or block-FP8 experts with a shared expert of the routed width,
    against float64 of the same quantized arithmetic and against the unquantized experts."""
    from flashinfra.kernels import fused_moe as fm

    quantize, bound = _quantizer(scheme)
    bound *= 2 if scheme == "w8a8" else 1.5  # two quantized GEMMs in a row
    gen = torch.Generator(device=device).manual_seed(seed)
    x = rnd(T, D, device=device, gen=gen, dtype=dtype)
    w13 = rnd(E + 1, 2 * I, D, device=device, gen=gen, scale=D**-0.5)  # the last one: the shared expert
    w2 = rnd(E + 1, D, I, device=device, gen=gen, scale=I**-0.5)
    q13, q2 = quantize(w13[:E]), quantize(w2[:E])
    qs13, qs2 = quantize(w13[E]), quantize(w2[E])
    scales = (q13.scale, q2.scale, qs13.scale, qs2.scale)
    ids = torch.stack([torch.randperm(E, device=device, generator=gen)[:top_k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, top_k, device=device, generator=gen)
    with torch_fp8_activations(device):
        out = fm.fused_moe_launch(x, q13.data, q2.data, w, ids, limit, qs13.data, qs2.data, scales)
    ref = fm.fused_moe_ref(x, q13.data, q2.data, w, ids.long(), limit, qs13.data, qs2.data, scales)
    res = [check(f"{scheme}_moe", out, ref, **moe_tol(dtype))]
    full = fm.fused_moe_ref(x.double(), w13[:E].double(), w2[:E].double(), w.double(), ids.long(), limit,
                            w13[E].double(), w2[E].double())
    return res + [within(f"{scheme}_moe.quant_error", out, full, bound, "the unquantized experts"),
                  within(f"{scheme}_moe_ref.quant_error", ref, full, bound, "the unquantized experts")]


def norm_int8(device: str, T: int, D: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """The RMSNorm fused with the int8 quantization of its output (``norm_act``), its outputs poisoned before the
    run (NaN; codes -128, which the quantizer never writes): the normed rows against float64 of the same
    arithmetic (rounded to ``dtype`` twice, as the norm rounds them: a rounding step apart at most), the scales and
    codes against float64's quantization of those rows (codes one step apart at a rounding tie at most) and
    within half a step of them; and every
    output bit for bit the unfused pair's (``norms.rms_norm`` then ``act.quant_int8_per_token``), with the normed
    rows kept and not."""
    from flashinfra.kernels import norms
    from flashinfra.kernels.quant import act as qa
    from flashinfra.kernels.quant import norm_act as na

    gen = torch.Generator(device=device).manual_seed(seed)
    x = rnd(T, D, device=device, gen=gen, dtype=dtype, scale=3.0)
    w = (1 + 0.5 * rnd(D, device=device, gen=gen)).to(dtype)
    x[0] = 0  # an all-zero row: scale 1, zeros out
    eps = 1e-5

    def poisoned(keep: bool):
        return (torch.full((T, D), float("nan"), dtype=dtype, device=device) if keep else None,
                torch.full((T, D), -128, dtype=torch.int8, device=device),
                torch.full((T,), float("nan"), device=device))

    y, q, s = na.rms_norm_int8_launch(x, w, eps, True, out=poisoned(True))
    xd = x.double()
    n = (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)).to(dtype)
    y64 = (w.double() * n.double()).to(dtype).double()
    # the quantization of the rows the kernel normed (a row one rounding step apart has its own codes)
    amax = y.double().abs().amax(-1)
    s64 = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    v = y.double() / s64[:, None]
    q64 = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-127, 127)
    ulp = torch.finfo(dtype).eps
    res = [check("norm_int8.normed", y, y64, atol=1e-6, rtol=2 * ulp),
           check("norm_int8.scales", s, s64, atol=0, rtol=1e-6)]
    steps = (q.double() - q64).abs()
    res.append(holds("norm_int8.codes", int(steps.max()) <= 1 and float((steps > 0).double().mean()) < 1e-3,
                     f"largest code difference {int(steps.max())}, fraction differing "
                     f"{float((steps > 0).double().mean()):.2e} (ties: 1, < 1e-3)"))
    res.append(check("norm_int8.dequant", q.double() * s.double()[:, None], y.double(),
                     atol=float(s.max()) * 0.5 + 1e-6, rtol=0))
    yr = norms.rms_norm_launch(x, w, eps)
    qr, sr = qa.quant_int8_per_token_launch(yr)
    _, q2, s2 = na.rms_norm_int8_launch(x, w, eps, False, out=poisoned(False))
    for name, a, b in (("normed", y, yr), ("codes", q, qr), ("scales", s, sr), ("codes, rows not kept", q2, qr),
                       ("scales, rows not kept", s2, sr)):
        res.append(holds(f"norm_int8.unfused_{name}", torch.equal(a, b), "bit for bit the unfused kernels'"))
    return res
