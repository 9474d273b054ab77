"""The vision tower's fused kernels on a CUDA device at the tower's sizes (16 heads x 64, hidden 1024, inner 4096),
bf16, and a tiny tower on the kernel path against its reference (``flashinfra.kernels.vision_cases``)."""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import vision_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16


@pytest.mark.parametrize("S,L", [(2, 1024), (3, 999)])
def test_qk_norm_rope(S, L):
    assert_passed(cases.qk_norm_rope("cuda", S, L, 16, 64, dtype=BF16, seed=L))


def test_add_rms_norm():
    assert_passed(cases.add_rms_norm("cuda", 1000, 1024, dtype=BF16, seed=1))


def test_clamped_swiglu():
    assert_passed(cases.clamped_swiglu("cuda", 63, 4096, dtype=BF16, seed=2))


def test_tower_on_the_kernel_path():
    assert_passed(cases.vision_tower("cuda", [(1, 4, 4), (1, 4, 4)], seed=3))
    assert_passed(cases.vision_tower("cuda", [(1, 4, 4), (1, 2, 6)], seed=4))
