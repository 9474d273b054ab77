"""Checks of the 8-bit kernels (activation quantization, alone and fused with the RMSNorm, W8A8 and block-FP8
linear, their fused MoE experts, sparse MLA over an 8-bit latent, the DSA selection over an fp8 indexer cache),
registered with ``flashinfra.feedback``.

Checks (``flashinfra check quant``) run the cases of check_cases.py at fixed sizes: on CUDA when there is one
(bf16 activations; the fp8 checks need sm_89+ and report a skip below it), else float32 on the CPU under Triton's
interpreter, in a child process (``python -m flashinfra.kernels.interpreted flashinfra.kernels.quant.checks
NAME``), since ``TRITON_INTERPRET=1`` must be set before Triton compiles anything.
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult, register_check
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter
from flashinfra.kernels import checks as hotpath
from flashinfra.kernels.quant import check_cases as cases

TAGS = ("kernel", "quant", "triton")


def named(prefix: str, results: list[CheckResult]) -> list[CheckResult]:
    """The cases' results under the check's name."""
    for r in results:
        r.name = f"{prefix}.{r.name}"
    return results


def _checked(name: str, fp8: bool = False):
    """Register ``fn(device, dtype)`` as check ``name``: run on CUDA, or re-run under the interpreter."""
    def wrap(fn):
        def run() -> list[CheckResult]:
            dev = kernel_device()
            if dev is None:
                return run_in_interpreter("flashinfra.kernels.quant.checks", name)
            if fp8 and dev == "cuda" and torch.cuda.get_device_capability() < (8, 9):
                return [CheckResult(name=name, passed=True, message="skipped: fp8 needs sm_89+")]
            return named(name, fn(dev, torch.bfloat16 if dev == "cuda" else torch.float32))
        run.__qualname__ = f"check_{name}"
        run.__doc__ = fn.__doc__
        return register_check(name, tags=TAGS)(run)
    return wrap


def _fp8_ok(dev: str) -> bool:
    return dev != "cuda" or torch.cuda.get_device_capability() >= (8, 9)


@_checked("quant.act")
def check_act(dev, act):
    """Per-token int8 and per-group e4m3 activation quantization against their torch references."""
    T, K = (33, 4096) if dev == "cuda" else (7, 300)
    return cases.quant_act(dev, T, K, dtype=act, seed=1)


@_checked("quant.norm_int8")
def check_norm_int8(dev, act):
    """RMSNorm fused with the int8 quantization of its output against float64, and bit for bit the unfused pair."""
    T, D = (33, 6144) if dev == "cuda" else (7, 300)
    return cases.norm_int8(dev, T, D, dtype=act, seed=6)


@_checked("quant.w8a8_linear")
def check_w8a8_linear(dev, act):
    """int8 x int8 GEMM against float64 of the same codes, and the W8A8 linear against the unquantized product."""
    T, K, N = (63, 4096, 1536) if dev == "cuda" else (7, 300, 37)
    return cases.linear(dev, "w8a8", T, K, N, dtype=act, bias=True, seed=2)


@_checked("quant.fp8_block_linear", fp8=True)
def check_fp8_block_linear(dev, act):
    """e4m3 block-scaled GEMM against float64 of the same codes, and the linear against the unquantized product."""
    T, K, N = (63, 4096, 1536) if dev == "cuda" else (5, 300, 200)
    return cases.linear(dev, "fp8", T, K, N, dtype=act, bias=True, seed=3)


def _moe_sizes(dev: str) -> tuple:
    return (37, 16, 1024, 512, 8) if dev == "cuda" else (9, 5, 40, 24, 2)


@_checked("quant.w8a8_moe")
def check_w8a8_moe(dev, act):
    """The W8A8 fused MoE experts against float64 of the same quantized arithmetic and the unquantized experts."""
    return cases.moe(dev, "w8a8", *_moe_sizes(dev), dtype=act, seed=4)


@_checked("quant.fp8_moe", fp8=True)
def check_fp8_moe(dev, act):
    """The block-FP8 fused MoE experts against float64 of the same quantized arithmetic and the unquantized ones."""
    return cases.moe(dev, "fp8", *_moe_sizes(dev), dtype=act, seed=5)


@_checked("quant.sparse_mla_8bit_latent")
def check_sparse_mla_quant(dev, act):
    """Sparse MLA over an int8 latent (and an fp8 one where fp8 runs), one pass and split over the selection."""
    if dev == "cuda":
        ctx, qlens, sz = [0, 100, 1000], [33, 1, 1], dict(H=64, R=512, bs=64, S=256 + 3)
    else:
        ctx, qlens, sz = [0, 5, 30, 40], [13, 1, 7, 1], dict(H=4, R=32, bs=4, S=11)
    out = []
    for cache_dtype in ("int8", "fp8") if _fp8_ok(dev) else ("int8",):
        for split in (None, 4):
            out += named(f"{cache_dtype}.split{split or 1}",
                         hotpath.sparse_mla(dev, ctx, qlens, cache=cache_dtype, split=split, dtype=act, **sz))
    return out


@_checked("quant.dsa_select", fp8=True)
def check_dsa_select(dev, act):
    """The DSA top-k selection over an fp8 indexer cache against ``Indexer.select`` on the dequantized entries."""
    if dev == "cuda":
        return hotpath.dsa_select(dev, [0, 100, 1000], [30, 1, 1], Hi=32, Di=128, kpool=4, topk=256, bs=64, fp8=True,
                                  dtype=act)
    return hotpath.dsa_select(dev, [0, 5, 30], [13, 1, 7], fp8=True, seed=3)
