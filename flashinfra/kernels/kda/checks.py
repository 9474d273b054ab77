"""Checks and benchmarks of the KDA and conv kernels, registered with ``flashinfra.feedback``.

Checks (``flashinfra check kda``) run the cases of check_cases.py at fixed sizes: on CUDA when there is one, else
on the CPU under Triton's interpreter (in a child process started with ``TRITON_INTERPRET=1``, since the variable
must be set before Triton compiles anything; ``python -m flashinfra.kernels.interpreted MODULE NAME`` is that
child, printing its results as JSON). Benchmarks (``flashinfra bench kda``) time the ops at GLM-5.3-Flash sizes
(H=64, K=V=128; ``quick``: small).
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, compare, register_benchmark, \
    register_check
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter
from flashinfra.kernels.kda import check_cases as cases
from flashinfra.kernels.kda import check_intra_cases as intra_cases
from flashinfra.kernels.kda import check_verify_cases as verify_cases
from flashinfra.kernels.kda import conv
from flashinfra.kernels.kda import decode as layer
from flashinfra.kernels.kda import prefill as pre
from flashinfra.kernels.kda import ref as kda_ref

TAGS = ("kernel", "kda", "triton")


def named(prefix: str, results: list[CheckResult]) -> list[CheckResult]:
    """The cases' results under the check's name."""
    for r in results:
        r.name = f"{prefix}.{r.name}"
    return results


def _run(name: str, fn) -> list[CheckResult]:
    """``fn(device)`` on the kernels' device, or the check re-run under the interpreter."""
    dev = kernel_device()
    if dev is None:
        return run_in_interpreter("flashinfra.kernels.kda.checks", name)
    return named(name, fn(dev))


def _sizes(device: str) -> dict:
    return dict(H=8, K=128) if device == "cuda" else dict(H=2, K=16)


@register_check("kda.prefill", tags=TAGS)
def check_prefill() -> list[CheckResult]:
    """float32 inputs (the 16-token kernels), then bf16 and fp16 inputs (the 64-token kernels), plain and with the
    gate fused (the model's op), against float64 on the same (rounded) inputs; both families with a bf16 state."""
    def run(dev):
        sz = _sizes(dev)
        lens = [63, 3, 200] if dev == "cuda" else [63, 3, 20]
        out = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            tag = str(dtype)[6:]
            out += named(tag, cases.prefill_varlen(dev, lens, V=sz["K"], dtype=dtype, **sz))
            out += named(f"{tag}.gated", cases.prefill_varlen(dev, lens, V=sz["K"], dtype=dtype, gated=True, **sz))
        for dtype in (torch.float32, torch.bfloat16):
            out += named(f"{str(dtype)[6:]}.bfloat16_state", cases.prefill_varlen(
                dev, lens, V=sz["K"], dtype=dtype, gated=True, state_dtype=torch.bfloat16, **sz))
        return out

    return _run("kda.prefill", run)


@register_check("kda.prefill_intra", tags=TAGS)
def check_prefill_intra() -> list[CheckResult]:
    """The 64-token prefill's gate pass, diagonal and off-diagonal kernels alone against float64, their scratch
    poisoned, in the launcher's shapes on CUDA (bf16, tf32 products)."""
    def run(dev):
        if dev == "cuda":
            lens, sz, kw = [1000, 63, 1, 300, 64, 129], dict(H=8, K=128), dict(dtype=torch.bfloat16, precision="tf32")
            diag = dict(kw, KS=32, num_warps=2, kg=True, a_lo=False)
        else:
            lens, sz, kw = [70, 1, 0, 64, 129], dict(H=2, K=32), {}
            diag = dict(kg=True, a_lo=False)
        return (named("gate", intra_cases.gate_scratch(dev, lens, gated=True, **sz))
                + named("diag", intra_cases.intra_diag(dev, lens, decay=0.1, **sz, **diag))
                + named("offdiag", intra_cases.intra_offdiag(dev, lens, decay=0.1, **sz, **kw)))

    return _run("kda.prefill_intra", run)


@register_check("kda.prefill_recurrence", tags=TAGS)
def check_prefill_recurrence() -> list[CheckResult]:
    """The public prefill op against the token-by-token float64 recurrence (independent of ref.py)."""
    return _run("kda.prefill_recurrence", lambda dev: cases.prefill_recurrence(dev))


@register_check("kda.prefill_checkpoints", tags=TAGS)
def check_prefill_checkpoints() -> list[CheckResult]:
    """Prefix checkpoints inside a prefill: the states written at chunk boundaries, inside chunks (the short tail
    pass) and at a sequence's end, for the 16-token (float32) and 64-token (bf16, gated) kernels, against the
    token-by-token float64 recurrence; and the conv windows saved there, bit for bit."""
    def run(dev):
        lens, points = [150, 70], [(0, 64), (0, 80), (0, 128), (0, 150), (1, 3), (1, 64), (1, 69)]
        H, K = (4, 128) if dev == "cuda" else (2, 16)
        return (named("float32", cases.prefill_checkpoints(dev, lens, points, H=H, K=K, V=K))
                + named("bfloat16.gated", cases.prefill_checkpoints(dev, lens, points, H=H, K=K, V=K,
                                                                    dtype=torch.bfloat16, gated=True))
                + named("bfloat16.bfloat16_state", cases.prefill_checkpoints(
                    dev, lens, points, H=H, K=K, V=K, dtype=torch.bfloat16, state_dtype=torch.bfloat16))
                + named("float32.bfloat16_state", cases.prefill_checkpoints(
                    dev, lens, points, H=H, K=K, V=K, gated=True, state_dtype=torch.bfloat16))
                + named("conv", cases.conv_checkpoints(dev, lens, points)))

    return _run("kda.prefill_checkpoints", run)


@register_check("kda.gate", tags=("kernel", "kda"))
def check_gate() -> list[CheckResult]:
    """The gate's formula, which the kernels fuse, against it written out in float64."""
    return named("kda.gate", cases.gate("cuda" if torch.cuda.is_available() else "cpu"))


@register_check("kda.layer_decode", tags=TAGS)
def check_layer_decode() -> list[CheckResult]:
    """Both layouts (B=1, B=9), float32 and bf16 states, and the micro-batches of a CUDA graph bit for bit."""
    def run(dev):
        sz = _sizes(dev)
        act = torch.bfloat16 if dev == "cuda" else torch.float32
        out = []
        for state_dtype in (torch.float32, torch.bfloat16):
            tag = f"{str(state_dtype)[6:]}_state"
            for B in (1, 9):
                out += named(f"{tag}.b{B}", cases.layer_decode(dev, B, sz["H"], sz["K"], state_dtype, act))
            out += named(tag, cases.layer_decode_micro_batches(dev, 9, sz["H"], sz["K"], state_dtype, act))
        return out

    return _run("kda.layer_decode", run)


@register_check("kda.layer_verify", tags=TAGS)
def check_layer_verify() -> list[CheckResult]:
    """The ReplaySSM verify over runs of 1 to 8 tokens (and an empty one), float32 and bf16 states: against the
    float64 reference verify, bit for bit the decode kernel stepped token by token, and the fold after it."""
    def run(dev):
        sz = _sizes(dev)
        act = torch.bfloat16 if dev == "cuda" else torch.float32
        out = []
        for state_dtype in (torch.float32, torch.bfloat16):
            out += named(f"{str(state_dtype)[6:]}_state",
                         verify_cases.layer_verify(dev, [4, 1, 8, 0, 2], sz["H"], sz["K"], state_dtype, act))
        return out

    return _run("kda.layer_verify", run)


@register_check("kda.conv1d", tags=("kernel", "conv", "triton"))
def check_conv() -> list[CheckResult]:
    def run(dev):
        C = 3 * _sizes(dev)["H"] * _sizes(dev)["K"] + 5
        return named("prefill", cases.conv_prefill(dev, [2, 37, 1], C)) + named("decode", cases.conv_decode(dev, 3, C))

    return _run("kda.conv1d", run)


@register_check("kda.conv1d_window", tags=("kernel", "conv", "triton"))
def check_conv_window() -> list[CheckResult]:
    """The public conv ops against explicit float64 window sums (independent of conv.py's references)."""
    return _run("kda.conv1d_window", lambda dev: cases.conv_window(dev))


def _layer_inputs(dev: str, B: int, H: int, K: int, state_dtype: torch.dtype, act_dtype: torch.dtype):
    a = cases.layer_decode_inputs(dev, B, H, K, state_dtype, act_dtype)
    a["state"] = a["state"] * 0.1
    return a


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
            a = cases.layer_decode_inputs(dev, Bq, H, K, state_dtype, act, seed=seed)
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


@register_benchmark("kda.decode", tags=("kernel", "kda"))
def bench_decode(ctx: BenchContext) -> BenchSpec:
    """The layer decode step at the context's device and dtype (the public op: kernels on CUDA, the reference on
    the CPU), checked against the float64 reference from a known state."""
    B, H, K = (4, 4, 32) if ctx.quick else (64, 64, 128)
    dtype = ctx.torch_dtype()
    names = list(cases.layer_decode_inputs(ctx.device, 1, 1, 16))

    def make_inputs(seed: int):
        a = cases.layer_decode_inputs(ctx.device, B, H, K, torch.float32, dtype, seed=seed)
        return tuple(a[n] for n in names)

    def check(inputs, out):
        # the timed calls updated the slots in place; re-run from a copy of the inputs to check the output
        a = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in zip(names, inputs)}
        r = {n: cases.f64(t.clone()) if isinstance(t, torch.Tensor) else t for n, t in a.items()}
        o = layer.kda_layer_decode(**a)
        return compare("kda.decode.o", o, kda_ref.kda_layer_decode_ref(**r), dtype=dtype)

    itemsize = torch.empty((), dtype=dtype).element_size()
    return BenchSpec(
        fn=layer.kda_layer_decode, make_inputs=make_inputs, check=check,
        bytes=B * H * K * K * 4 * 2 + B * H * K * itemsize * 6, flops=B * H * K * K * 7,
        params={"B": B, "H": H, "K": K}, description="KDA layer decode step, state read and written in place")


@register_benchmark("kda.conv1d.decode", tags=("kernel", "conv"))
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
    return BenchSpec(fn=conv.causal_conv1d_decode, make_inputs=make_inputs,
                     bytes=B * C * (2 * itemsize + 2 * (W - 1) * 4) + C * W * 4, flops=B * C * (2 * W + 4),
                     params={"B": B, "C": C, "W": W}, description="short conv decode step over q|k|v channels")


@register_benchmark("kda.conv1d.prefill.t8192", tags=("kernel", "conv"))
def bench_conv_prefill(ctx: BenchContext) -> BenchSpec:
    """An 8192-token chunk of one sequence with a history (a later chunk of a long prompt), q|k|v channels in a
    row of the fused projection's output, as the model hands them over."""
    T, C, W = (64, 256, 4) if ctx.quick else (8192, 3 * 64 * 128, 4)
    dtype = ctx.torch_dtype()
    weight = torch.randn(C, W, device=ctx.device)
    conv_state = torch.randn(1, C, W - 1, device=ctx.device).to(dtype)

    def make_inputs(seed: int):
        gen = torch.Generator(device=ctx.device).manual_seed(seed)
        return torch.randn(T, C, device=ctx.device, generator=gen).to(dtype), weight, conv_state, [0, T], [0], [True]

    itemsize = torch.empty((), dtype=dtype).element_size()
    return BenchSpec(fn=conv.causal_conv1d_prefill, make_inputs=make_inputs,
                     bytes=2 * T * C * itemsize + C * W * 4 + 2 * C * (W - 1) * itemsize, flops=T * C * (2 * W + 4),
                     params={"T": T, "C": C, "W": W}, description="short conv over a prompt chunk's q|k|v channels")
