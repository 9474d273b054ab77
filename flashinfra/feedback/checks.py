"""Checks and benchmarks of the public ops in ``flashinfra.kernels``, against float64 references written
here independently (token-by-token recurrences, explicit window sums), so the chunked references and any
Triton kernel behind the ops are both held to them.

Checks run on CUDA when it is available, else on the CPU (where the ops run their references). Inputs
are fresh random tensors at odd sizes; state slots that an op must not read are poisoned with NaN, and
slots it must not touch are checked to still hold their poison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashinfra.feedback import ceilings
from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, compare, register_benchmark, \
    register_check
from flashinfra.kernels.kda.conv import causal_conv1d_decode, causal_conv1d_prefill
from flashinfra.kernels.kda.ref import kda_decode_ref as kda_decode
from flashinfra.kernels.kda.ref import kda_gate_ref
from flashinfra.kernels.kda.prefill import kda_prefill


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def l2norm_f64(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent_f64(q, k, v, g, beta, state):
    """One sequence, token by token, in float64: q/k/v/g [L, H, *], beta [L, H], state [H, K, V]."""
    K = q.shape[-1]
    q, k = l2norm_f64(q) * K**-0.5, l2norm_f64(k)
    v, g, beta, S = v.double(), g.double(), beta.double(), state.double().clone()
    o = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][..., None] * delta[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def _untouched(name: str, state: torch.Tensor, slots: list[int]) -> CheckResult:
    """Slots outside ``slots`` must still hold their NaN poison."""
    others = [s for s in range(state.shape[0]) if s not in set(slots)]
    still_poisoned = torch.isnan(state[others]).double()
    return compare(name, still_poisoned, torch.ones_like(still_poisoned), atol=0, rtol=0)


def _kda_inputs(T, H, K, V, dtype, device):
    q, k = (torch.randn(T, H, K, device=device).to(dtype) for _ in range(2))
    v = torch.randn(T, H, V, device=device).to(dtype)
    g = kda_gate_ref(torch.randn(T, H, K, device=device), torch.rand(H, device=device) * 2 - 1,
                     torch.randn(H * K, device=device), lower_bound=-5.0)
    beta = torch.rand(T, H, device=device).sigmoid()
    return q, k, v, g, beta


@register_check("op.kda_gate", tags=("kernel", "kda"))
def check_kda_gate() -> list[CheckResult]:
    T, H, K = 37, 3, 20
    g_raw = torch.randn(T, H, K, device=_device())
    A_log, dt_bias = torch.randn(H, device=_device()), torch.randn(H * K, device=_device())
    g64 = g_raw.double() + dt_bias.double().view(1, H, K)
    rate = A_log.double().exp().view(1, H, 1)
    bounded = -5.0 * torch.sigmoid(rate * g64)
    unbounded = -rate * torch.log1p(torch.exp(g64))
    return [compare("op.kda_gate.lower_bound", kda_gate_ref(g_raw, A_log, dt_bias, -5.0), bounded),
            compare("op.kda_gate.softplus", kda_gate_ref(g_raw, A_log, dt_bias, None), unbounded)]


@register_check("op.kda_decode", tags=("kernel", "kda"))
def check_kda_decode() -> list[CheckResult]:
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        B, H, K, V, num_slots = 5, 3, 16, 24, 9
        q, k, v, g, beta = _kda_inputs(B, H, K, V, dtype, _device())
        slots = [7, 0, 4, 2, 8]
        state = torch.full((num_slots, H, K, V), float("nan"), device=_device())
        state[slots] = torch.randn(B, H, K, V, device=_device()) * 0.5
        s0 = state[slots].clone()
        o = kda_decode(q, k, v, g, beta, state, torch.tensor(slots, device=_device()))
        ref_o, ref_s = zip(*(kda_recurrent_f64(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1],
                                               beta[b:b + 1], s0[b]) for b in range(B)))
        tag = str(dtype).removeprefix("torch.")
        results += [compare(f"op.kda_decode.{tag}.o", o, torch.cat(ref_o), dtype=dtype),
                    compare(f"op.kda_decode.{tag}.state", state[slots], torch.stack(ref_s), dtype=torch.float32),
                    _untouched(f"op.kda_decode.{tag}.other_slots", state, slots)]
    return results


@register_check("op.kda_prefill", tags=("kernel", "kda"))
def check_kda_prefill() -> list[CheckResult]:
    lens, slots, has_initial = [1, 63, 70], [3, 0, 5], [False, True, True]
    H, K, V, num_slots = 2, 16, 12, 7
    T = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = _kda_inputs(T, H, K, V, torch.float32, _device())
    state = torch.full((num_slots, H, K, V), float("nan"), device=_device())
    for slot, init in zip(slots, has_initial):
        if init:
            state[slot] = torch.randn(H, K, V, device=_device()) * 0.5
    s0 = state.clone()
    o = kda_prefill(q, k, v, g, beta, state, cu, slots, has_initial)
    ref_o, ref_s = [], []
    for b, (slot, init) in enumerate(zip(slots, has_initial)):
        bos, eos = cu[b], cu[b + 1]
        start = s0[slot] if init else torch.zeros(H, K, V, device=_device())
        ob, sb = kda_recurrent_f64(q[bos:eos], k[bos:eos], v[bos:eos], g[bos:eos], beta[bos:eos], start)
        ref_o.append(ob)
        ref_s.append(sb)
    # on CUDA the op runs the chunked kernels, whose in-chunk products are tf32 (about 1e-3 relative); on the CPU
    # its float32 reference
    tol = dict(atol=5e-3, rtol=5e-3) if o.is_cuda else {}
    return [compare("op.kda_prefill.o", o, torch.cat(ref_o), **tol),
            compare("op.kda_prefill.state", state[slots], torch.stack(ref_s), **tol),
            _untouched("op.kda_prefill.other_slots", state, slots)]


def conv_f64(xs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """xs [C, W - 1 + L] (history then inputs), weight [C, W] -> silu(window sums) [L, C] in float64."""
    W, L = weight.shape[1], xs.shape[1] - weight.shape[1] + 1
    y = sum(weight[:, w, None].double() * xs[:, w:w + L].double() for w in range(W))
    return F.silu(y).t()


@register_check("op.causal_conv1d", tags=("kernel", "conv"))
def check_causal_conv1d() -> list[CheckResult]:
    C, W, num_slots = 37, 4, 6
    lens, slots, has_initial = [2, 1, 41], [5, 1, 3], [True, False, True]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    dev = _device()
    x = torch.randn(cu[-1], C, device=dev)
    weight = torch.randn(C, W, device=dev)
    conv_state = torch.full((num_slots, C, W - 1), float("nan"), device=dev)
    for slot, init in zip(slots, has_initial):
        if init:
            conv_state[slot] = torch.randn(C, W - 1, device=dev)
    s0 = conv_state.clone()
    out = causal_conv1d_prefill(x, weight, conv_state, cu, slots, has_initial)
    ref, ref_state = [], []
    for b, (slot, init) in enumerate(zip(slots, has_initial)):
        history = s0[slot] if init else torch.zeros(C, W - 1, device=dev)
        xs = torch.cat([history.double(), x[cu[b]:cu[b + 1]].t().double()], dim=-1)
        ref.append(conv_f64(xs, weight))
        ref_state.append(xs[:, -(W - 1):])
    results = [compare("op.causal_conv1d.prefill", out, torch.cat(ref)),
               compare("op.causal_conv1d.prefill_state", conv_state[slots], torch.stack(ref_state)),
               _untouched("op.causal_conv1d.prefill_other_slots", conv_state, slots)]
    xd = torch.randn(len(slots), C, device=dev)
    s1 = conv_state.clone()
    out_d = causal_conv1d_decode(xd, weight, conv_state, torch.tensor(slots, device=dev))
    xs_d = torch.cat([s1[slots].double(), xd.double()[:, :, None]], dim=-1)  # [B, C, W]
    ref_d = torch.stack([conv_f64(xs_d[b], weight)[0] for b in range(len(slots))])
    results += [compare("op.causal_conv1d.decode", out_d, ref_d),
                compare("op.causal_conv1d.decode_state", conv_state[slots], xs_d[:, :, 1:]),
                _untouched("op.causal_conv1d.decode_other_slots", conv_state, slots)]
    return results


@register_benchmark("op.kda_decode", tags=("kernel", "kda"))
def bench_kda_decode(ctx: BenchContext) -> BenchSpec:
    B, H, K, V = (4, 4, 32, 32) if ctx.quick else (64, 64, 128, 128)
    dtype = ctx.torch_dtype()
    state = torch.randn(B, H, K, V, device=ctx.device)
    slots = torch.arange(B, device=ctx.device)

    def make_inputs(seed: int):
        torch.manual_seed(seed)
        q, k, v, g, beta = _kda_inputs(B, H, K, V, dtype, ctx.device)
        return q, k, v, g, beta, state, slots

    def check(inputs, out):
        q, k, v, g, beta, _, _ = inputs
        # The timed call updated the state in place; re-run from a known state to check the output.
        s0 = torch.randn(B, H, K, V, device=ctx.device) * 0.5
        s = s0.clone()
        o = kda_decode(q, k, v, g, beta, s, slots)
        ref = torch.cat([kda_recurrent_f64(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], s0[b])[0]
                         for b in range(B)])
        return compare("op.kda_decode.o", o, ref, dtype=dtype)

    itemsize = torch.empty((), dtype=dtype).element_size()
    return BenchSpec(
        fn=kda_decode, make_inputs=make_inputs, check=check,
        bytes=B * H * K * V * 4 * 2 + B * H * (3 * K * itemsize + K * 4 + V * itemsize * 2),
        flops=B * H * K * V * 7, params={"B": B, "H": H, "K": K, "V": V},
        description="KDA decode step, state read and written in place")


@register_benchmark("op.causal_conv1d.decode", tags=("kernel", "conv"))
def bench_conv_decode(ctx: BenchContext) -> BenchSpec:
    B, C, W = (8, 256, 4) if ctx.quick else (64, 3 * 64 * 128, 4)
    dtype = ctx.torch_dtype()
    weight = torch.randn(C, W, device=ctx.device)
    conv_state = torch.randn(B, C, W - 1, device=ctx.device)
    slots = torch.arange(B, device=ctx.device)

    def make_inputs(seed: int):
        gen = torch.Generator(device=ctx.device).manual_seed(seed)
        return torch.randn(B, C, device=ctx.device, generator=gen).to(dtype), weight, conv_state, slots

    itemsize = torch.empty((), dtype=dtype).element_size()
    return BenchSpec(fn=causal_conv1d_decode, make_inputs=make_inputs,
                     bytes=B * C * (2 * itemsize + 2 * (W - 1) * 4) + C * W * 4, flops=B * C * (2 * W + 4),
                     params={"B": B, "C": C, "W": W}, description="short conv decode step over q|k|v channels")


@register_check("ceilings", tags=("feedback",))
def check_ceilings() -> list[CheckResult]:
    """The ops that ``bench ceilings`` times compute what their byte and FLOP counts assume."""
    src = torch.randn(1000, 37, device=_device())
    dst = torch.full_like(src, float("nan"))
    dst.copy_(src)
    a, b = torch.randn(63, 130, device=_device()), torch.randn(130, 17, device=_device())
    return [compare("ceilings.copy", dst, src.double(), atol=0, rtol=0),
            compare("ceilings.matmul", torch.mm(a, b), a.double() @ b.double(), atol=1e-4, rtol=1e-4)]


@register_benchmark("ceilings.copy", tags=("feedback", "roofline"))
def bench_copy(ctx: BenchContext) -> BenchSpec:
    """The copy ``bench ceilings`` measures: its fraction of the copy ceiling should come out near 1."""
    n = ceilings.copy_numel(ctx.device, ctx.quick)
    dst = torch.empty(n, device=ctx.device)

    def make_inputs(seed: int):
        return dst, torch.randn(n, device=ctx.device, generator=torch.Generator(ctx.device).manual_seed(seed))

    return BenchSpec(fn=lambda d, s: d.copy_(s), make_inputs=make_inputs, bytes=2 * n * 4,
                     check=lambda inputs, out: compare("ceilings.copy", out, inputs[1], atol=0, rtol=0),
                     params={"numel": n}, description="float32 device copy")


@register_benchmark("ceilings.matmul", tags=("feedback", "roofline"))
def bench_matmul(ctx: BenchContext) -> BenchSpec:
    n = ceilings.matmul_size(ctx.device, ctx.quick)
    dtype = ctx.torch_dtype() if ctx.device.startswith("cuda") else torch.float32

    def make_inputs(seed: int):
        gen = torch.Generator(ctx.device).manual_seed(seed)
        return (torch.randn(n, n, device=ctx.device, generator=gen).to(dtype),
                torch.randn(n, n, device=ctx.device, generator=gen).to(dtype))

    def check(inputs, out):
        rows = slice(0, 7)  # a float64 product of the full matrices would dominate the run
        ref = inputs[0][rows].double() @ inputs[1].double()
        return compare("ceilings.matmul", out[rows], ref, dtype=dtype,
                       atol=1e-2 * n**0.5, rtol=1e-2 if dtype != torch.float32 else 1e-4)

    return BenchSpec(fn=torch.mm, make_inputs=make_inputs, flops=2 * n**3, bytes=3 * n * n * dtype.itemsize,
                     check=check, params={"n": n, "dtype": str(dtype)}, description="square matmul")
