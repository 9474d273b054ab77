"""The penalties kernel under Triton's CPU interpreter against the float64 reference, the rows it must not touch
poisoned (``flashinfra.kernels.check_cases.penalties``). Collected only through ``test_interpret.py``."""

import pytest

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import check_cases as cases


@pytest.mark.parametrize("N,V,P,S", [(9, 1030, 5, 12), (4, 100, 4, 4), (16, 2049, 1, 40), (3, 64, 0, 2)])
def test_penalties(N, V, P, S):
    assert_passed(cases.penalties("cpu", N, V, P, S, seed=N + P))


def test_registered_check_passes():
    import flashinfra.kernels.checks  # noqa: F401  (registers it)
    from flashinfra.feedback.registry import checks

    assert_passed(checks()["hotpath.penalties"].fn())
