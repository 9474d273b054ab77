"""The ReplaySSM verify kernel on a CUDA device at real sizes (H=64 heads over the batch, K=V=128), against the
float64 reference verify, the decode kernel stepped token by token, and the fold after it."""

import pytest
import torch

from flashinfra.kernels.kda import check_verify_cases as cases
from tests.kernels.kda_cases import assert_passed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [6, 1, 0, 8, 3, 2, 4, 5]])
def test_layer_verify_real_size(lens, state_dtype):
    assert_passed(cases.layer_verify("cuda", lens, H=8, K=128, state_dtype=state_dtype, dtype=torch.bfloat16))
