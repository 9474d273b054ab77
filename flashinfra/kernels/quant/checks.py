"""Checks of the quantized kernels (W8A8 and block-FP8 linear, their fused MoE, sparse MLA over an 8-bit latent,
the DSA selection over an fp8 indexer cache), registered with ``flashinfra.feedback``.

Each check quantizes fresh random inputs with the torch quantizers, runs the launcher on them, and compares with
the float64 computation of the same quantized arithmetic: on CUDA when there is one (the fp8 checks need sm_89+),
else under Triton's CPU interpreter in a child process (``python -m flashinfra.kernels.interpreted
flashinfra.kernels.quant.checks NAME``). Activations are quantized before the launch (not inside it) so that the
interpreter's e4m3 conversion, which mis-rounds at exponent carries, does not enter.
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult, compare, register_check
from flashinfra.kernels.quant import act as quant_act
from flashinfra.kernels.quant import fp8_experts as fp8_moe
from flashinfra.kernels.quant import fp8_gemm as fp8_block_linear
from flashinfra.kernels.quant import sparse_mla as sparse_mla_quant
from flashinfra.kernels.quant import w8a8_experts as w8a8_moe
from flashinfra.kernels.quant import w8a8_gemm as w8a8_linear
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter
from flashinfra.quant.weights import quantize_fp8_blocks, quantize_int8_per_channel

TAGS = ("kernel", "quant", "triton")


def _checked(name: str, fp8: bool = False):
    def wrap(fn):
        def run() -> list[CheckResult]:
            dev = kernel_device()
            if dev is None:
                return run_in_interpreter("flashinfra.kernels.quant.checks", name)
            if fp8 and dev == "cuda" and torch.cuda.get_device_capability() < (8, 9):
                return [CheckResult(name=name, passed=True, message="skipped: fp8 needs sm_89+")]
            return fn(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
        run.__qualname__ = f"check_{name}"
        return register_check(name, tags=TAGS)(run)
    return wrap


def _tol(act) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if act == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@_checked("quant.w8a8_linear")
def check_w8a8_linear(dev, act):
    T, K, N = (63, 4096, 1536) if dev == "cuda" else (7, 300, 37)
    x, w = torch.randn(T, K, device=dev).to(act), torch.randn(N, K, device=dev) * K**-0.5
    qw = quantize_int8_per_channel(w)
    xq, sx = quant_act.quant_int8_per_token_ref(x)
    kq, ks = quant_act.quant_int8_per_token_launch(x)
    y = w8a8_linear.w8a8_matmul_launch(xq, sx, qw.data, qw.scale, None, act)
    ref = w8a8_linear.w8a8_matmul_ref(xq, sx, qw.data, qw.scale, None, torch.float64)
    steps = (kq.int() - xq.int()).abs()
    return [compare("quant.w8a8_linear.act_scales", ks, sx, atol=0, rtol=0),
            CheckResult(name="quant.w8a8_linear.act_codes", passed=int(steps.max()) <= 1,
                        message=f"largest code difference {int(steps.max())} (1 at a rounding tie)"),
            compare("quant.w8a8_linear.matmul", y, ref, **_tol(act))]


@_checked("quant.fp8_block_linear", fp8=True)
def check_fp8_block_linear(dev, act):
    T, K, N = (63, 4096, 1536) if dev == "cuda" else (5, 300, 200)
    x, w = torch.randn(T, K, device=dev).to(act), torch.randn(N, K, device=dev) * K**-0.5
    qw = quantize_fp8_blocks(w)
    xq, sx = quant_act.quant_fp8_per_group_ref(x)
    y = fp8_block_linear.fp8_matmul_launch(xq, sx, qw.data, qw.scale, qw.block, None, act)
    ref = fp8_block_linear.fp8_matmul_ref(xq, sx, qw.data, qw.scale, qw.block, None, torch.float64)
    return [compare("quant.fp8_block_linear.matmul", y, ref, **_tol(act))]


def _moe_inputs(dev, act, quantize):
    T, E, D, I, k = (37, 16, 1024, 512, 8) if dev == "cuda" else (9, 5, 40, 24, 2)
    x = torch.randn(T, D, device=dev).to(act)
    q13 = quantize(torch.randn(E, 2 * I, D, device=dev) * D**-0.5)
    q2 = quantize(torch.randn(E, D, I, device=dev) * I**-0.5)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)]).to(torch.int32)
    return x, q13, q2, torch.rand(T, k, device=dev), ids


@_checked("quant.w8a8_moe")
def check_w8a8_moe(dev, act):
    x, q13, q2, w, ids = _moe_inputs(dev, act, quantize_int8_per_channel)
    y = w8a8_moe.w8a8_moe_launch(x, q13.data, q13.scale, q2.data, q2.scale, w, ids, 10.0)
    ref = w8a8_moe.w8a8_moe_ref(x, q13.data, q13.scale, q2.data, q2.scale, w, ids.long(), 10.0)
    # the intermediate's int8 codes may differ by one at a rounding tie of the gate values
    return [compare("quant.w8a8_moe", y, ref, atol=5e-3, rtol=5e-3) if act == torch.float32 else
            compare("quant.w8a8_moe", y, ref, **_tol(act))]


@_checked("quant.fp8_moe", fp8=True)
def check_fp8_moe(dev, act):
    x, q13, q2, w, ids = _moe_inputs(dev, act, quantize_fp8_blocks)
    quantize = fp8_moe.quant_fp8_per_group
    if dev == "cpu":
        fp8_moe.quant_fp8_per_group = quant_act.quant_fp8_per_group_ref
    try:
        y = fp8_moe.fp8_moe_launch(x, q13.data, q13.scale, q2.data, q2.scale, w, ids, 10.0)
    finally:
        fp8_moe.quant_fp8_per_group = quantize
    ref = fp8_moe.fp8_moe_ref(x, q13.data, q13.scale, q2.data, q2.scale, w, ids.long(), 10.0)
    return [compare("quant.fp8_moe", y, ref, atol=5e-3, rtol=5e-3) if act == torch.float32 else
            compare("quant.fp8_moe", y, ref, **_tol(act))]


@_checked("quant.sparse_mla_int8_latent")
def check_sparse_mla_quant(dev, act):
    H, R, bs, T, S = (64, 512, 64, 33, 256) if dev == "cuda" else (4, 32, 4, 5, 11)
    nblocks = 4 * T
    latent = torch.randn(nblocks * bs, R, device=dev)
    q8, s = quant_act.quant_int8_per_token_ref(latent)
    q8, s = q8.view(nblocks, bs, R), s.view(nblocks, bs).contiguous()
    tables = torch.randperm(nblocks, device=dev)[: T * 4].view(T, 4).to(torch.int32)
    n = 4 * bs
    sel = torch.stack([torch.randperm(n, device=dev)[:S] for _ in range(T)]).to(torch.int32)
    sel[:, -1] = -1
    q = torch.randn(T, H, R, device=dev).to(act)
    seq = torch.arange(T, device=dev, dtype=torch.int32)
    y = sparse_mla_quant.sparse_mla_quant_launch(q, q8, s, sel, seq, tables, R**-0.5)
    ref = sparse_mla_quant.sparse_mla_quant_ref(q.double(), q8, s, sel, seq, tables, R**-0.5)
    return [compare("quant.sparse_mla_int8_latent", y, ref, **_tol(act))]
