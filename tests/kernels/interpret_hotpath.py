"""The hot-path Triton kernels (norms, mHC, MoE, DSA indexer, sparse MLA) run by Triton's CPU interpreter at
small, odd sizes against float64 references. Collected only through ``test_interpret.py``, which
runs this file in a subprocess with ``TRITON_INTERPRET=1``. (The interpreter's bf16 matrix product is not
exact, so bf16 runs live in the GPU tests.)"""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import cache_write_cases, check_cases as cases, mhc_cases
from tests.kernels import model_cases


@pytest.mark.parametrize("T,D", [(1, 64), (37, 100), (5, 1000)])
def test_norms(T, D):
    assert_passed(cases.norms("cpu", T, D, seed=T))


# (37, 300): more of the streams than one tile holds, so the collapse loops over the width
@pytest.mark.parametrize("T,D", [(1, 64), (37, 24), (5, 300), (2, 700), (37, 300)])
def test_mhc(T, D):
    assert_passed(mhc_cases.mhc("cpu", T, D, seed=T))


def test_cache_writes():
    assert_passed(cache_write_cases.cache_writes("cpu", 7, 48, 16))


def test_moe_align():
    assert_passed(cases.moe_align("cpu", 7, 5, 2, 4))
    assert_passed(cases.moe_align("cpu", 1, 288, 8, 16))
    assert_passed(cases.moe_align("cpu", 33, 8, 3, 16, seed=1))
    assert_passed(cases.moe_align("cpu", 300, 288, 8, 16, seed=2))  # past ONE_PROGRAM: count, layout, place


# 1 and 3 tokens (up to FMA_ROWS): the logits as multiply-adds over whole rows
@pytest.mark.parametrize("T,E,G,TG,k", [(19, 24, 1, 1, 3), (19, 16, 4, 2, 3), (19, 40, 8, 4, 8), (1, 24, 1, 1, 3),
                                        (3, 40, 8, 4, 8)])
def test_route(T, E, G, TG, k):
    assert_passed(cases.route("cpu", T, E, 100, k, G, TG, seed=E))


@pytest.mark.parametrize("T,E,D", [(1, 24, 100), (3, 40, 64), (9, 40, 100)])
def test_router_logits(T, E, D):
    assert_passed(cases.router_logits("cpu", T, E, D, seed=T))


@pytest.mark.parametrize("T,E,D,I,k,limit", [(7, 5, 24, 20, 2, 1.0), (1, 9, 16, 16, 3, 10.0), (40, 6, 17, 33, 2, 0.5)])
def test_fused_moe(T, E, D, I, k, limit):
    assert_passed(cases.fused_moe("cpu", T, E, D, I, k, limit=limit, seed=T))


def test_fused_moe_wider_shared_expert():
    assert_passed(cases.fused_moe("cpu", 5, 4, 16, 16, 2, shared_mult=2))


@pytest.mark.parametrize("ctx,qlens", [([0, 5, 30], [13, 1, 7]), ([63], [1]), ([0], [41])])
def test_dsa_select_varlen(ctx, qlens):
    assert_passed(cases.dsa_select("cpu", ctx, qlens, seed=len(ctx)))


def test_dsa_select_ties_go_to_recent_pools():
    assert_passed(cases.dsa_select("cpu", [0, 22], [33, 3], ties=True))


@pytest.mark.parametrize("kpool,topk,bs", [(1, 6, 4), (16, 32, 16)])
def test_dsa_select_kpool(kpool, topk, bs):
    assert_passed(cases.dsa_select("cpu", [60, 3], [5, 1], kpool=kpool, topk=topk, bs=bs))


@pytest.mark.parametrize("split", [None, 1, 4])
def test_sparse_mla(split):
    assert_passed(cases.sparse_mla("cpu", [0, 5, 30, 40], [13, 1, 7, 1], split=split, S=37 if split == 4 else 11))


def test_tiny_model_batched_greedy_same_with_kernels_and_references(tmp_path, monkeypatch):
    model_cases.tiny_model_batched_greedy_same(tmp_path, monkeypatch, "cpu")


def test_decode_fusions_taken(tmp_path, monkeypatch):
    model_cases.decode_fusions_taken(tmp_path, monkeypatch, "cpu")


def test_each_layer_as_accurate_as_the_references():
    model_cases.layerwise("cpu", "float32", torch.float64, factor=2.0, floor=1e-6, lengths=(13, 2))


def test_registered_checks_pass():
    import flashinfra.kernels.checks  # noqa: F401  (registers them)
    from flashinfra.feedback.registry import checks

    for name in ("hotpath.norms", "hotpath.mhc", "hotpath.moe", "hotpath.dsa_select", "hotpath.sparse_mla",
                 "hotpath.cache_writes"):
        assert_passed(checks()[name].fn())
