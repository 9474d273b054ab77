"""Prefix checkpoints inside a KDA prefill on the CPU: the references write the states at the checkpoint
positions, the conv windows are saved bit for bit, and the plan the kernels follow (checkpoints.py). The kernels'
cases run under the interpreter (interpret_kda.py) and on the GPU (test_kda_gpu.py)."""

import pytest
import torch

from flashinfra.kernels.kda.checkpoints import plan_checkpoints
from tests.kernels import kda_cases as cases


@pytest.mark.parametrize("gated", [False, True])
def test_reference_writes_the_states_at_checkpoints(gated):
    cases.prefill_checkpoints("cpu", [150, 70], [(0, 64), (0, 80), (0, 150), (1, 3), (1, 69)], gated=gated,
                              kernels=False)


def test_reference_checkpoints_in_float64():
    cases.prefill_checkpoints("cpu", [90], [(0, 17), (0, 64)], dtype=torch.float64, kernels=False)


def test_conv_windows_at_checkpoints():
    # p >= W - 1 everywhere (one gather), then windows reaching into the slot's history (fresh and continued)
    cases.conv_checkpoints("cpu", [40, 9, 30], [(0, 16), (0, 40), (1, 5), (2, 3)])
    cases.conv_checkpoints("cpu", [40, 9, 30], [(0, 16), (0, 1), (1, 2), (2, 2)])


def test_plan_places_each_checkpoint():
    # two sequences of 150 and 70 tokens, 64-token chunks: 3 + 2 chunks; the second continues its slot's state
    plan = plan_checkpoints([0, 150, 220], [0, 1], [False, True],
                            [(0, 64, 5), (0, 80, 6), (0, 128, 7), (0, 150, 8), (1, 3, 9), (1, 69, 10)], 64)
    assert plan.chunk_saves == [5, 7, 8, 10, -1]
    assert plan.before == [(1, 9)]  # inside the first chunk: from the sequence's initial state
    assert plan.after == [(5, 6)]  # a second slot at the boundary at 64, then carried on to 80
    assert plan.tail_rows == [(64, 16), (150, 3), (214, 5)]  # tails of 16, 3 and 5 tokens, batched
    assert plan.tail_slots == [6, 9, 10] and plan.tail_init == [True, True, True]
