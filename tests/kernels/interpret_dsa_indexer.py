"""The DSA indexer's pool-key cache, sliced selection and top-k select under Triton's CPU interpreter, against the
references (``flashinfra.kernels.dsa_indexer_cases``). Collected only through ``test_interpret.py``."""

import pytest

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import dsa_indexer_cases as cases

# request 0: a prompt in two chunks, then decode steps; request 1 hits its first 3 blocks (24 tokens at bs 8)
STEPS = [[(0, 0, 13)], [(0, 13, 30)], [(0, 30, 31), (1, 24, 33)], [(0, 31, 32), (1, 33, 34)],
         [(1, 34, 35)], [(0, 32, 33), (1, 35, 36)]]


@pytest.mark.parametrize("fp8", [False, True])
def test_pool_keys_write(fp8):
    assert_passed(cases.pool_keys_write("cpu", 29, fp8=fp8, seed=3))


@pytest.mark.parametrize("kpool,bs", [(4, 8), (1, 4)])
def test_pool_keys_write_kpool(kpool, bs):
    assert_passed(cases.pool_keys_write("cpu", 17, kpool=kpool, bs=bs, seed=kpool))


@pytest.mark.parametrize("fp8", [False, True])
def test_select_over_steps_and_a_prefix_hit(fp8):
    assert_passed(cases.dsa_select_steps("cpu", STEPS, prefix_blocks=3, fp8=fp8, seed=5))


def test_sliced_selection_equals_one_pass():
    assert_passed(cases.dsa_select_sliced("cpu", [0, 5, 30], [13, 1, 7], rows=3, seed=2))


@pytest.mark.parametrize("name", ["hotpath.dsa_pool_keys", "hotpath.dsa_topk"])
def test_registered_check_passes(name):
    from flashinfra.feedback.registry import checks

    assert_passed(checks()[name].fn())


@pytest.mark.parametrize("T,k,kpool,tail", [(7, 5, 4, 3), (1, 1, 4, 0), (9, 3, 1, 0), (3, 0, 4, 3), (5, 6, 16, 15)])
def test_positions_kernel(T, k, kpool, tail):
    assert_passed(cases.dsa_positions("cpu", T, k, kpool=kpool, tail=tail, seed=T))


# (P, k): P not a power of two, P = k (a power of two or not), k = 1 just past a power of two, one pool. The kernel is
# the same at any size: the model's decode row (k = 512 of 1,024 pools) is left to the GPU tests (the interpreter
# sorts 1,024 keys in seconds a row), and the registered check sorts rows of 259 pools (more than 256)
@pytest.mark.parametrize("P,k", [(37, 5), (64, 64), (40, 40), (33, 1), (1, 1)])
@pytest.mark.parametrize("path", ["sort", "rank"])
def test_topk_sort_and_rank_against_torch_topk(P, k, path):
    assert_passed(cases.topk_select("cpu", P, k, rows_per_kind=2, path=path, seed=P + k))


# (P, k, sort_max, rank_compares): select through the sort (below and at SORT_MAX_POOLS), through torch.topk (above
# it), with no rank select (0); through the rank select (the default limit: these few short rows)
@pytest.mark.parametrize("P,k,sort_max,rank_compares", [(45, 9, None, 0), (64, 7, 64, 0), (65, 7, 64, 0),
                                                        (259, 5, 64, 0), (45, 9, None, None), (259, 5, 64, None)])
def test_topk_select_against_torch_topk(P, k, sort_max, rank_compares):
    assert_passed(cases.topk_select("cpu", P, k, rows_per_kind=2, path="select", sort_max=sort_max,
                                    rank_compares=rank_compares, seed=P + k))


# (sort_max, rank_compares): the sort, torch.topk, the rank select
@pytest.mark.parametrize("sort_max,rank_compares", [(None, 0), (0, 0), (None, None)])
def test_selection_topk_equals_torch_topk(sort_max, rank_compares):
    assert_passed(cases.dsa_select_topk("cpu", [40, 3, 17], [1, 6, 2], sort_max=sort_max,
                                        rank_compares=rank_compares, seed=11))


def test_warm_up_threshold_runs_each_variant(monkeypatch):
    """The start-up run of the threshold select over the row lengths a configuration can meet (engine/warmup.py)
    goes through the real kernels, once per sample size and pool-count divisibility (the limits lowered so that the
    interpreter's rows stay short)."""
    from flashinfra.kernels import dsa_topk

    monkeypatch.setattr(dsa_topk, "THRESHOLD_MIN_POOLS", 1024)
    # the real kernels at S 1,024: 1,024 and 1,028 pools, each on one row (the ranking kernels) and two (the sampling
    # ones)
    assert dsa_topk.warm_up_threshold(1030, 8, 4, "cpu") == 4
    shapes = []
    monkeypatch.setattr(dsa_topk, "threshold_launch", lambda scores, k, **_: shapes.append(tuple(scores.shape)))
    # from 2,048 pools the sample is 2,048 keys: its two row lengths too
    assert dsa_topk.warm_up_threshold(2100, 8, 4, "cpu") == 8
    assert shapes == [(1, 1024), (2, 1024), (1, 1028), (2, 1028), (1, 2048), (2, 2048), (1, 2052), (2, 2052)]


def test_slices_start_aligned():
    """The selection's query slices hold whole multiples of 16 queries once they hold 16 (every slice then starts as
    aligned as the batch: the kernels' variants do not change midway through a long prompt)."""
    from flashinfra.kernels.dsa_indexer import KEY_BUFFER_BYTES, slice_rows

    for T, P in [(8192, 24576), (8192, 10240), (8192, 262144), (5, 262144), (8192, 1 << 26), (100, 1000)]:
        rows = slice_rows(T, P)
        assert 1 <= rows <= T and 4 * rows * P <= max(KEY_BUFFER_BYTES, 4 * P)
        assert rows == T or rows % 16 == 0 or rows < 16, (T, P, rows)
    assert slice_rows(8192, 24576) == 2720  # 2,730 fit
