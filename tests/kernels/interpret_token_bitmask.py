"""The grammar's token-bitmask kernel under Triton's CPU interpreter against the reference, bit for bit
(``flashinfra.kernels.check_cases.token_bitmask``). Collected only through ``test_interpret.py``."""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import check_cases as cases


@pytest.mark.parametrize("N,V,R,vocab", [(7, 100, 3, None), (9, 1030, 9, 1000), (5, 2049, 1, 2049),
                                          (64, 4096, 37, None)])
def test_token_bitmask(N, V, R, vocab):
    assert_passed(cases.token_bitmask("cpu", N, V, R, vocab_size=vocab, seed=N + R))


def test_token_bitmask_bf16():
    assert_passed(cases.token_bitmask("cpu", 6, 333, 4, vocab_size=300, dtype=torch.bfloat16, seed=3))


def test_no_constrained_row_leaves_the_logits():
    assert_passed(cases.token_bitmask("cpu", 4, 64, 0))


def test_registered_check_passes():
    import flashinfra.kernels.checks  # noqa: F401  (registers it)
    from flashinfra.feedback.registry import checks

    assert_passed(checks()["hotpath.token_bitmask"].fn())
