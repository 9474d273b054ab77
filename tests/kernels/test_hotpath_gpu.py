"""Hot-path kernels on a CUDA device at GLM-5.3-Flash sizes, in bf16 and float32, against float64 references;
the trained default model's greedy tokens with the kernels equal those with the references, and every layer of
a random model is as close to a higher-precision run with the kernels as with the references."""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import cache_write_cases, check_cases as cases, mhc_cases
from tests.kernels import model_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16


@pytest.mark.parametrize("T,dtype", [(1, BF16), (1000, BF16), (63, torch.float32)])
def test_norms(T, dtype):
    assert_passed(cases.norms("cuda", T, 4096, dtype=dtype, seed=T))
    assert_passed(cases.norms("cuda", T, 128, dtype=dtype, seed=T + 1))


# 32 and 33 tokens: a decode batch's collapse split over the width
@pytest.mark.parametrize("T,dtype", [(1, BF16), (32, BF16), (1000, BF16), (33, torch.float32)])
def test_mhc(T, dtype):
    assert_passed(mhc_cases.mhc("cuda", T, 4096, dtype=dtype, seed=T))


@pytest.mark.parametrize("T", [1, 3, 4])
def test_router_logits(T):
    assert_passed(cases.router_logits("cuda", T, 288, 4096, dtype=BF16, seed=T))


@pytest.mark.parametrize("T", [1, 67, 1000])
def test_route(T):
    assert_passed(cases.route("cuda", T, 288, 4096, 8, 1, 1, seed=T))
    assert_passed(cases.route("cuda", T, 256, 512, 8, 8, 4, seed=T))


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_cache_writes(dtype):
    assert_passed(cache_write_cases.cache_writes("cuda", 33, 512, 128, dtype=dtype))


def test_moe_align():
    assert_passed(cases.moe_align("cuda", 1, 288, 8, 16))
    assert_passed(cases.moe_align("cuda", 129, 288, 8, 16, seed=1))
    assert_passed(cases.moe_align("cuda", 1000, 288, 8, 64, seed=2))


@pytest.mark.parametrize("T,dtype", [(1, BF16), (300, BF16), (1000, BF16), (37, torch.float32), (1000, torch.float32)])
def test_fused_moe(T, dtype):  # 1000 tokens: over 64 pairs per expert, the prefill block shapes
    assert_passed(cases.fused_moe("cuda", T, 64, 1024, 512, 8, dtype=dtype, limit=10.0, seed=T))


@pytest.mark.parametrize("ctx,qlens", [([0, 500, 3000], [1000, 1, 7]), ([4095], [1]), ([2000] * 5, [1] * 5)])
def test_dsa_select_real_heads(ctx, qlens):
    assert_passed(cases.dsa_select("cuda", ctx, qlens, Hi=32, Di=128, kpool=4, topk=2048, bs=64, seed=len(ctx)))


def test_dsa_select_bf16_and_ties():
    assert_passed(cases.dsa_select("cuda", [3000, 9], [1, 700], Hi=32, Di=128, kpool=4, topk=512, bs=64, ties=True))
    assert_passed(cases.dsa_select("cuda", [0, 2100], [333, 1], Hi=32, Di=128, kpool=4, topk=512, bs=64, dtype=BF16))


@pytest.mark.parametrize("dtype,split", [(BF16, None), (BF16, 8), (torch.float32, 1)])
def test_sparse_mla_real_size(dtype, split):
    assert_passed(cases.sparse_mla("cuda", [0, 3000, 700], [65, 1, 1], H=64, R=512, bs=64, S=2051, split=split,
                                   dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trained_model_batched_greedy_same_with_kernels_and_references(tmp_path, monkeypatch, dtype):
    model_cases.tiny_model_batched_greedy_same(tmp_path, monkeypatch, "cuda", dtype=dtype, steps=24, trained=True)


# float32: the KDA chunk kernels run their in-chunk products in tf32 (the cross-chunk chain in tf32x3), so
# a KDA layer is tf32-accurate (~1e-4 of float64), where the float32 references are ~1e-7
@pytest.mark.parametrize("dtype,hi,floor", [("float32", torch.float64, 2e-3), ("bfloat16", torch.float32, 1e-3)])
def test_each_layer_as_accurate_as_the_references(dtype, hi, floor):
    model_cases.layerwise("cuda", dtype, hi, factor=2.0, floor=floor)


def test_decode_fusions_taken(tmp_path, monkeypatch):
    model_cases.decode_fusions_taken(tmp_path, monkeypatch, "cuda")
