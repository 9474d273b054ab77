"""Checks and benchmarks of the KDA and conv Triton kernels, registered with ``flashinfra.feedback``.

Checks (``flashinfra check kda``) run each Triton launcher on fresh random inputs at odd sizes, outputs
poisoned with NaN, against its reference computed in float64: on CUDA when there is one, else on the CPU
under Triton's interpreter (in a child process started with ``TRITON_INTERPRET=1``, since the variable
must be set before Triton compiles anything; ``python -m flashinfra.kernels.kda.checks NAME`` is that child,
printing its results as JSON). Benchmarks
(``flashinfra bench kda``) time the launchers at GLM-5.3-Flash sizes (H=64, K=V=128; ``quick``: small).
The comparisons with flash-linear-attention live in ``bench/kda_*.py``, which need it installed.
"""

from __future__ import annotations

import unittest.mock

import torch

from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, compare, register_benchmark, \
    register_check
from flashinfra.kernels.kda import conv as conv
from flashinfra.kernels.kda import decode as layer
from flashinfra.kernels.kda import prefill as pre
from flashinfra.kernels.kda import ref as kda_ref
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter

NAN = float("nan")




def _f64(t):
    return t.double().clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t




def _sizes(device: str) -> dict:
    return dict(H=64, K=128) if device == "cuda" else dict(H=2, K=16)


@register_check("kda.prefill", tags=("kernel", "kda", "triton"))
def check_prefill() -> list[CheckResult]:
    """float32 inputs (the v2 kernels), then bf16 inputs (v3, the default path of a bf16 model), plain and
    with the gate fused (the model's op), against float64 on the same (rounded) inputs."""
    dev = kernel_device()
    if dev is None:
        return run_in_interpreter("flashinfra.kernels.kda.checks", "kda.prefill")
    H, K = _sizes(dev)["H"] // 8 or 1, _sizes(dev)["K"]
    lens = [63, 1, 200] if dev == "cuda" else [63, 1, 20]
    T, cu = sum(lens), [0, lens[0], lens[0] + lens[1], sum(lens)]
    slots, init = [4, 2, 0], [True, False, True]
    results = []
    for act in (torch.float32, torch.bfloat16):
        tag = "kda.prefill" if act == torch.float32 else "kda.prefill.bf16"
        q, k, v = (torch.randn(T, H, K, device=dev).to(act) for _ in range(3))
        g = -5 * torch.sigmoid(torch.randn(T, H, K, device=dev))
        beta = torch.rand(T, H, device=dev)
        state = torch.randn(5, H, K, K, device=dev)
        state[2] = NAN  # slot of the fresh sequence: must be ignored
        s64 = state.double().clone()
        s64[2] = 0
        ref = kda_ref.kda_prefill_ref(*(_f64(t) for t in (q, k, v, g, beta)), s64, cu, slots, init)
        out = torch.full((T, H, K), NAN, device=dev, dtype=act)
        pre.kda_prefill_launch(q, k, v, g, beta, state, cu, slots, init, out=out)
        if act == torch.float32:
            tol = dict(atol=1e-5, rtol=1e-4) if dev == "cpu" else dict(atol=5e-3, rtol=5e-3)
            s_tol = tol
        else:  # the bf16 output's rounding; the state as the GPU tests bound it (bf16x3 chain)
            tol, s_tol = dict(atol=2e-2, rtol=2e-2), dict(atol=2e-3, rtol=2e-3)
        results += [compare(f"{tag}.o", out, ref, **tol), compare(f"{tag}.state", state[slots], s64[slots], **s_tol)]
    # the model's op: the gate from its raw projection with the lower bound, beta from its logits; q, k, v, act
    # and the tolerances are the loop's last (bf16) case
    g_raw, b_logits = torch.randn(T, H, K, device=dev).to(act), torch.randn(T, H, device=dev)
    A_log, dt_bias = torch.randn(H, device=dev) * 0.3, torch.randn(H * K, device=dev)
    state = torch.randn(5, H, K, K, device=dev)
    state[2] = NAN
    s64 = state.double().clone()
    s64[2] = 0
    ref = kda_ref.kda_prefill_gated_ref(*(_f64(t) for t in (q, k, v, g_raw, b_logits, A_log, dt_bias)), -5.0, s64, cu,
                                    slots, init)
    out = torch.full((T, H, K), NAN, device=dev, dtype=act)
    pre.kda_prefill_gated_launch(q, k, v, g_raw, b_logits, A_log, dt_bias, -5.0, state, cu, slots, init, out=out)
    return results + [compare("kda.prefill.bf16_gated.o", out, ref, **tol),
                      compare("kda.prefill.bf16_gated.state", state[slots], s64[slots], **s_tol)]


def _layer_inputs(dev: str, B: int, H: int, K: int, state_dtype: torch.dtype, act_dtype: torch.dtype, W: int = 4):
    C = 3 * H * K

    def rnd(*shape, dtype=act_dtype, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    return dict(qkv=rnd(B, C), conv_weight=rnd(C, W, dtype=torch.float32, scale=0.5), conv_state=rnd(B, C, W - 1),
                g_raw=rnd(B, H * K), beta_logits=rnd(B, H), gate=rnd(B, H * K),
                A_log=rnd(H, dtype=torch.float32, scale=0.3), dt_bias=rnd(H * K, dtype=torch.float32),
                lower_bound=-5.0, norm_weight=rnd(K), eps=1e-5, state=rnd(B, H, K, K, dtype=state_dtype, scale=0.1),
                state_slots=torch.randperm(B, device=dev))


def _check_layer(name: str, state_dtype: torch.dtype) -> list[CheckResult]:
    dev = kernel_device()
    if dev is None:
        return run_in_interpreter("flashinfra.kernels.kda.checks", name)
    act = torch.bfloat16 if dev == "cuda" else torch.float32
    a = _layer_inputs(dev, 9, _sizes(dev)["H"], _sizes(dev)["K"], state_dtype, act)
    r = {n: _f64(t) for n, t in a.items()}
    ref = kda_ref.kda_layer_decode_ref(**r)
    split = {**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()}
    out = torch.full(ref.shape, NAN, dtype=act, device=dev)
    layer.kda_layer_decode_launch(**a, out=out)
    # the same step in the two micro-batches of a CUDA graph (rows 0-3 and 4-8; on two streams on CUDA): the same
    # results, bit for bit
    out_split = torch.full(ref.shape, NAN, dtype=act, device=dev)
    with unittest.mock.patch.object(layer, "in_graph_capture", lambda qkv: True):
        layer.kda_layer_decode_launch(**split, out=out_split)
    # bf16 activations (CUDA): the kernels round the conv outputs to bf16 as the unfused conv does and the float64
    # reference does not, so the output and the new state carry that rounding (the GPU tests' bounds)
    exact = state_dtype == torch.float32 and act == torch.float32
    o_tol = {} if act == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    state_tol = dict(atol=1e-5, rtol=1e-4) if exact else dict(atol=1e-2, rtol=1e-2)
    return [compare(f"{name}.o", out, ref, **o_tol), compare(f"{name}.state", a["state"], r["state"], **state_tol),
            compare(f"{name}.conv_state", a["conv_state"], r["conv_state"], atol=0, rtol=0),
            *(compare(f"{name}.micro_batches.{n}", x, y, atol=0, rtol=0) for n, x, y in (
                ("o", out_split, out), ("state", split["state"], a["state"]),
                ("conv_state", split["conv_state"], a["conv_state"])))]


@register_check("kda.layer_decode", tags=("kernel", "kda", "triton"))
def check_layer_decode() -> list[CheckResult]:
    return _check_layer("kda.layer_decode", torch.float32)


@register_check("kda.layer_decode_bf16_state", tags=("kernel", "kda", "triton"))
def check_layer_decode_bf16() -> list[CheckResult]:
    return _check_layer("kda.layer_decode_bf16_state", torch.bfloat16)


@register_check("kda.conv1d", tags=("kernel", "conv", "triton"))
def check_conv() -> list[CheckResult]:
    dev = kernel_device()
    if dev is None:
        return run_in_interpreter("flashinfra.kernels.kda.checks", "kda.conv1d")
    C, W, lens = 3 * _sizes(dev)["H"] * _sizes(dev)["K"] + 5, 4, [2, 37, 1]
    T, cu = sum(lens), [0, 2, 39, 40]
    x, w = torch.randn(T, C, device=dev), torch.randn(C, W, device=dev)
    cs = torch.randn(4, C, W - 1, device=dev)
    slots, init = [3, 0, 1], [False, True, True]
    cs64 = cs.double().clone()
    ref = conv.causal_conv1d_prefill_ref(_f64(x), _f64(w), cs64, cu, slots, init)
    out = torch.full_like(x, NAN)
    conv.causal_conv1d_prefill_launch(x, w, cs, cu, slots, init, out=out)
    xd = torch.randn(3, C, device=dev)
    dslots = torch.tensor([1, 2, 0], device=dev)
    ref_d = conv.causal_conv1d_decode_ref(_f64(xd), _f64(w), cs64, dslots)
    out_d = torch.full_like(xd, NAN)
    conv.causal_conv1d_decode_launch(xd, w, cs, dslots, out=out_d)
    return [compare("kda.conv1d.prefill", out, ref), compare("kda.conv1d.decode", out_d, ref_d),
            compare("kda.conv1d.state", cs, cs64, atol=0, rtol=0)]


def _bench_device(ctx: BenchContext) -> str:
    return "cuda" if ctx.device.startswith("cuda") else "cpu"


def _register_layer_bench(B: int, state_dtype: torch.dtype, tag: str):
    @register_benchmark(f"kda.layer_decode.{tag}.b{B}", tags=("kernel", "kda", "triton"))
    def bench(ctx: BenchContext) -> BenchSpec:
        dev = _bench_device(ctx)
        H, K = (2, 16) if ctx.quick else (64, 128)
        Bq = min(B, 4) if ctx.quick else B
        act = torch.bfloat16 if dev == "cuda" else torch.float32
        names = list(_layer_inputs(dev, 1, H, K, state_dtype, act))

        def make_inputs(seed: int):
            torch.manual_seed(seed)
            a = _layer_inputs(dev, Bq, H, K, state_dtype, act)
            return tuple(a[n] for n in names)

        esize = torch.empty((), dtype=state_dtype).element_size()
        return BenchSpec(
            fn=layer.kda_layer_decode, make_inputs=make_inputs,
            bytes=Bq * H * K * K * esize * 2 + Bq * 3 * H * K * 3 * 2 * 2 + Bq * 6 * H * K * 2,
            flops=Bq * H * K * K * 6,
            description=f"fused KDA layer decode (conv, gate, beta, L2, recurrence, gated RMSNorm), {tag} state",
            params=dict(B=Bq, H=H, K=K, state=tag),
        )


for _B in (1, 16, 64, 256):
    _register_layer_bench(_B, torch.float32, "fp32")
    _register_layer_bench(_B, torch.bfloat16, "bf16")


@register_benchmark("kda.prefill.t8192", tags=("kernel", "kda", "triton"))
def bench_prefill(ctx: BenchContext) -> BenchSpec:
    dev = _bench_device(ctx)
    T, H, K = (128, 2, 16) if ctx.quick else (8192, 64, 128)
    act = torch.bfloat16 if dev == "cuda" else torch.float32

    def make_inputs(seed: int):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(T, H, K, device=dev).to(act) for _ in range(3))
        g = -5 * torch.sigmoid(torch.randn(T, H, K, device=dev))
        return q, k, v, g, torch.rand(T, H, device=dev), torch.zeros(1, H, K, K, device=dev), [0, T], [0], [False]

    return BenchSpec(
        fn=pre.kda_prefill, make_inputs=make_inputs,
        bytes=T * H * K * (4 * act.itemsize + 4) + T * H * 4 + 2 * H * K * K * 4, flops=T * H * K * K * 2 * 3,
        description="KDA chunked prefill, one sequence", params=dict(T=T, H=H, K=K),
    )
