"""The ReplaySSM verify kernel run by Triton's CPU interpreter at small sizes. Collected only through
``test_interpret.py``, which runs this file in a subprocess with ``TRITON_INTERPRET=1``."""

import pytest
import torch

from flashinfra.kernels.kda import check_verify_cases as cases
from flashinfra.model.replay import kda_layer_verify
from tests.kernels.kda_cases import assert_passed


@pytest.mark.parametrize("state_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("lens", [[1], [6, 1, 0, 3], [2, 5]])
def test_layer_verify(lens, state_dtype, dtype):
    assert_passed(cases.layer_verify("cpu", lens, H=2, K=8, state_dtype=state_dtype, dtype=dtype))


@pytest.mark.parametrize("W,lower_bound", [(2, None), (3, -5.0)])
def test_layer_verify_conv_widths_and_gate(W, lower_bound):
    """Runs longer than the conv window (every tap from the run) and shorter (taps from the slot)."""
    assert_passed(cases.layer_verify("cpu", [5, 1], H=1, K=24, W=W, lower_bound=lower_bound, seed=3))


def test_dispatch_runs_the_kernel_and_checks_the_ring():
    """``kda_layer_verify`` (lists of slots and offsets) takes the kernel here and refuses runs longer than the
    ring."""
    a = cases.verify_inputs("cpu", [3, 2], H=1, K=8)
    ring = cases.poisoned_ring(4, 3, 1, 8, torch.float32, "cpu")
    args = [a[n] for n in ("qkv", "conv_weight", "conv_state", "g_raw", "beta_logits", "gate", "A_log", "dt_bias",
                           "lower_bound", "norm_weight", "eps", "state")]
    slots = a["state_slots"].tolist()
    out = kda_layer_verify(*args, ring, slots, [0, 3, 5])
    assert not out.isnan().any() and not ring.x[slots[0], :3].isnan().any()
    with pytest.raises(ValueError, match="ring"):
        kda_layer_verify(*args, cases.poisoned_ring(4, 2, 1, 8, torch.float32, "cpu"), slots, [0, 3, 5])
