"""Quantized kernels on a CUDA device at GLM-5.3-Flash sizes (bf16 activations) against float64 references of the
same quantized arithmetic and against the unquantized product. The fp8 kernels need sm_89 or newer."""

import pytest
import torch

from tests.kernels import quant_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("T", [1, 33, 1000])
def test_quant_act(T):
    cases.quant_act("cuda", T, 4096, dtype=BF16, seed=T)


@pytest.mark.parametrize("T,K,N", [(1, 4096, 12288), (32, 4096, 1536), (1000, 8192, 4096), (63, 1536, 16384)])
def test_w8a8_linear(T, K, N):
    cases.w8a8_linear("cuda", T, K, N, dtype=BF16, seed=T)


@pytest.mark.skipif(not _fp8_ok(), reason="fp8 tensor cores need sm_89+")
@pytest.mark.parametrize("T,K,N", [(1, 4096, 12288), (32, 4096, 1536), (1000, 8192, 4096)])
def test_fp8_block_linear(T, K, N):
    cases.fp8_block_linear("cuda", T, K, N, dtype=BF16, seed=T)


@pytest.mark.parametrize("T", [1, 32, 1024])
def test_w8a8_moe(T):
    cases.w8a8_moe("cuda", T, 64, 4096, 2048, 8, dtype=BF16, seed=T)  # 64 experts: the float64 reference fits


@pytest.mark.skipif(not _fp8_ok(), reason="fp8 tensor cores need sm_89+")
@pytest.mark.parametrize("T", [1, 32, 1024])
def test_fp8_moe(T):
    cases.fp8_moe("cuda", T, 64, 4096, 2048, 8, dtype=BF16, seed=T)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("ctx,qlens", [([0, 100, 3000], [300, 1, 1]), ([4000] * 32, [1] * 32)])
def test_sparse_mla_quant(cache_dtype, ctx, qlens):
    if cache_dtype == "fp8" and not _fp8_ok():
        pytest.skip("fp8 needs sm_89+")
    cases.sparse_mla_quant("cuda", ctx, qlens, cache_dtype, H=64, R=512, bs=64, S=2048 + 3, dtype=BF16)


@pytest.mark.parametrize("quantization,kv", [("w8a8", "int8"), ("fp8", "fp8"), ("none", "int8"), ("w8a8", "auto")])
def test_quantized_model_kernels_match_references(tmp_path, monkeypatch, quantization, kv):
    if "fp8" in (quantization, kv) and not _fp8_ok():
        pytest.skip("fp8 needs sm_89+")
    cases.quant_model_kernels_match_references(tmp_path, monkeypatch, "cuda", quantization, kv)


@pytest.mark.skipif(not _fp8_ok(), reason="fp8 needs sm_89+")
@pytest.mark.parametrize("ctx,qlens", [([0, 100, 3000], [300, 1, 1]), ([4000] * 8, [1] * 8)])
def test_dsa_select_quant(ctx, qlens):
    cases.dsa_select_quant("cuda", ctx, qlens, Hi=32, Di=128, kpool=4, topk=2048, bs=64, dtype=BF16)
