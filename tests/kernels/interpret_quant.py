"""The quantized kernels run by Triton's CPU interpreter at small, odd sizes against float64 references of the same
quantized arithmetic. Collected only through ``test_interpret.py``, which runs this file in a subprocess
with ``TRITON_INTERPRET=1``. The interpreter runs int8 and e4m3 ``tl.dot`` exactly (numpy products), so the fp8
kernels are tested here too; its float -> e4m3 conversion mis-rounds at exponent carries (see
``flashinfra.kernels.quant.check_cases.quant_act``), which the GPU tests check bit for bit."""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import check_cases as hotpath
from flashinfra.kernels.quant import check_cases as cases
from tests.kernels import model_cases

# The model cases' prompts at 13 and 2 tokens (not 37, 5 and 20): two sequences of different lengths, the longer with
# more pools (kpool 4) than the indexer's top k (2 pools), the shorter inside one pool, and the decode steps
# completing a pool. The interpreter's forward pass takes about a third of a second a prefill token and more for
# each sequence; the same kernels and branches run as at the full lengths
PROMPT_LENGTHS = (13, 2)


@pytest.mark.parametrize("T,K", [(1, 64), (7, 300), (33, 1000), (2, 16500)])  # the last: two passes a row
def test_quant_act(T, K):
    assert_passed(cases.quant_act("cpu", T, K, seed=T))


@pytest.mark.parametrize("T,K,N,bias", [(1, 64, 48, False), (7, 300, 37, True), (70, 130, 150, False)])
def test_w8a8_linear(T, K, N, bias):
    assert_passed(cases.linear("cpu", "w8a8", T, K, N, bias=bias, seed=T))


@pytest.mark.parametrize("T,K,N,bias,rows", [(1, 128, 64, False, 128), (5, 300, 200, True, 128),
                                             (40, 257, 129, False, 128), (5, 300, 200, False, 32)])
def test_fp8_block_linear(T, K, N, bias, rows):
    assert_passed(cases.linear("cpu", "fp8", T, K, N, bias=bias, seed=T, block_rows=rows))


@pytest.mark.parametrize("T,E,D,I,k,limit", [(9, 5, 40, 24, 2, 10.0), (1, 9, 16, 16, 3, 10.0), (40, 6, 17, 33, 2, 0.5)])
def test_w8a8_moe(T, E, D, I, k, limit):
    assert_passed(cases.moe("cpu", "w8a8", T, E, D, I, k, limit=limit, seed=T))


# gemm1's column tiles inside one weight block (I a multiple of them) or across two
@pytest.mark.parametrize("T,E,D,I,k", [(9, 5, 40, 24, 2), (20, 4, 200, 160, 2), (12, 4, 136, 128, 2)])
def test_fp8_moe(T, E, D, I, k):
    assert_passed(cases.moe("cpu", "fp8", T, E, D, I, k, seed=T))


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("split", [None, 4])
def test_sparse_mla_quant(cache_dtype, split):
    assert_passed(hotpath.sparse_mla("cpu", [0, 5, 30, 40], [13, 1, 7, 1], cache=cache_dtype, split=split,
                                     S=37 if split else 11))


def test_quantized_model_kernels_match_references(tmp_path, monkeypatch):
    # W8A8 weights and an int8 latent cache together (fp8 on the GPU only: the interpreter's e4m3 conversion)
    model_cases.quant_model_kernels_match_references(tmp_path, monkeypatch, "cpu", "w8a8", "int8",
                                                     lengths=PROMPT_LENGTHS)


def test_w8a8_norm_fusion_leaves_the_kernels_logits_unchanged(tmp_path, monkeypatch):
    model_cases.w8a8_norm_fusion_leaves_logits_unchanged(tmp_path, monkeypatch, "cpu", kernels=True,
                                                         lengths=PROMPT_LENGTHS)


@pytest.mark.parametrize("ctx,qlens", [([0, 5, 30], [13, 1, 7]), ([63], [1])])
def test_dsa_select_quant(ctx, qlens):
    assert_passed(hotpath.dsa_select("cpu", ctx, qlens, fp8=True, seed=len(ctx)))


@pytest.mark.parametrize("T,D,dtype", [(1, 64, torch.float32), (7, 300, torch.bfloat16), (33, 1000, torch.float32),
                                       (20, 130, torch.bfloat16)])
def test_rms_norm_int8(T, D, dtype):
    assert_passed(cases.norm_int8("cpu", T, D, dtype=dtype, seed=T))
