"""The vision tower's fused kernels and the tower on the kernel path under Triton's CPU interpreter, against the
references (``flashinfra.kernels.vision_cases``). Collected only through ``test_interpret.py``."""

import pytest

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import vision_cases as cases


@pytest.mark.parametrize("S,L,H,hd", [(3, 7, 2, 8), (1, 17, 3, 16), (2, 1, 1, 4)])
def test_qk_norm_rope(S, L, H, hd):
    assert_passed(cases.qk_norm_rope("cpu", S, L, H, hd, seed=S * L))


@pytest.mark.parametrize("T,I", [(5, 40), (3, 1100)])
def test_clamped_swiglu(T, I):
    assert_passed(cases.clamped_swiglu("cpu", T, I, seed=T))


@pytest.mark.parametrize("grids", [[(1, 4, 4), (1, 4, 4)], [(1, 4, 4), (1, 2, 6), (2, 2, 2)]])
def test_tower_on_the_kernel_path(grids):
    assert_passed(cases.vision_tower("cpu", grids, seed=len(grids)))


def test_registered_check_passes():
    from flashinfra.feedback.registry import checks

    assert_passed(checks()["hotpath.vision"].fn())


@pytest.mark.parametrize("T,D", [(7, 100), (18, 64)])
def test_add_rms_norm(T, D):
    assert_passed(cases.add_rms_norm("cpu", T, D, seed=T))
