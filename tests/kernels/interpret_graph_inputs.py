"""The graph-inputs fill under Triton's CPU interpreter against its tensor-op reference, every destination poisoned
(``flashinfra.kernels.check_cases.graph_inputs``). Collected only through ``test_interpret.py``."""

import pytest

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import check_cases as cases


@pytest.mark.parametrize("bs,q,B,w,W", [(8, 5, 5, 9, 300), (4, 1, 4, 3, 16), (16, 4, 1, 1, 64), (2, 3, 0, 0, 16),
                                         (3, 6, 3, 16, 16), (3, 1, 2, 600, 1024)])
def test_graph_inputs(bs, q, B, w, W):
    assert_passed(cases.graph_inputs("cpu", bs, q, B, w, W, seed=bs + q + B))


def test_registered_check_passes():
    import flashinfra.kernels.checks  # noqa: F401  (registers it)
    from flashinfra.feedback.registry import checks

    assert_passed(checks()["hotpath.graph_inputs"].fn())
