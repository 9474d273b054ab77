"""The DSA indexer's pool-key cache, sliced selection and top-k select on a CUDA device at GLM-5.3-Flash sizes (32
heads x 128, kpool 4, block size 64, 512 pools of 262,144 at 1M context), bf16 and e4m3 entries, against the
references (``flashinfra.kernels.dsa_indexer_cases``)."""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import dsa_indexer_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16
REAL = dict(Hi=32, Di=128, kpool=4, bs=64)
# request 0: a prompt in two chunks, then decode steps; request 1 hits its first 10 blocks (640 tokens)
STEPS = [[(0, 0, 301)], [(0, 301, 700)], [(0, 700, 701), (1, 640, 903)], [(0, 701, 702), (1, 903, 904)],
         [(0, 702, 703), (1, 904, 905)], [(0, 703, 704)]]


@pytest.mark.parametrize("fp8", [False, True])
def test_pool_keys_write(fp8):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs sm_89+")
    assert_passed(cases.pool_keys_write("cuda", 1000, Di=128, bs=64, fp8=fp8, dtype=BF16, seed=1))


@pytest.mark.parametrize("fp8,dtype", [(False, BF16), (False, torch.float32), (True, BF16)])
def test_select_over_steps_and_a_prefix_hit(fp8, dtype):
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs sm_89+")
    assert_passed(cases.dsa_select_steps("cuda", STEPS, prefix_blocks=10, topk=256, fp8=fp8, dtype=dtype, seed=7,
                                         **REAL))


def test_sliced_selection_equals_one_pass():
    assert_passed(cases.dsa_select_sliced("cuda", [0, 2100, 700], [333, 1, 65], rows=37, topk=512, dtype=BF16,
                                          **REAL))


@pytest.mark.parametrize("P", [600, 1024])  # P not a power of two, the longest row select sorts (SORT_MAX_POOLS)
def test_topk_sort_against_torch_topk(P):
    assert_passed(cases.topk_select("cuda", P, 512, rows_per_kind=2, seed=P))


@pytest.mark.parametrize("P", [262144, 16385, 2048])
def test_topk_select_against_torch_topk(P):
    assert_passed(cases.topk_select("cuda", P, 512, rows_per_kind=2, path="select", seed=P))


@pytest.mark.parametrize("P,k", [(262144, 512), (16385, 512), (1048576, 2048), (2048, 512)])
def test_topk_threshold_against_torch_topk(P, k):
    assert_passed(cases.topk_select("cuda", P, k, rows_per_kind=2, path="threshold", seed=P))
    assert_passed(cases.topk_select("cuda", P, k, rows_per_kind=2, path="threshold_ranked", seed=P + 1))
    assert_passed(cases.topk_threshold_fallback("cuda", min(P, 20000), k, 4 * k, seed=P))


def test_threshold_counts_sorted_and_ranked():  # both ways to the sample's thresholds, the same ones
    assert_passed(cases.topk_threshold_counts("cuda", 262144, 512, rows_per_kind=2, seed=5))


def test_topk_kpool_1():  # index_topk 2048 pools of 1 token: k = 2048 over 1M pools
    assert_passed(cases.topk_select("cuda", 1048576, 2048, path="select", seed=1))


def test_selection_topk_at_1m_context():  # a decode row and a prefill slice over 262,144 pools
    assert_passed(cases.dsa_select_topk("cuda", [1048575, 1047552], [1, 1024], topk=2048, dtype=BF16, seed=3,
                                        **REAL))
