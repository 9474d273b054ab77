"""A step's integer inputs reach the device in one packed copy: ``HostStaging`` round-trips every array bit for
bit, and a decode step of the engine makes exactly one upload and no other ``torch.tensor`` on its way to the
model and through sampling (greedy, and seeded with top-p and logprobs)."""

from __future__ import annotations

import sys

import pytest
import torch

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.forward_batch import TENSOR_FIELDS, ForwardBatch
from flashinfra.model.staging import HostStaging


def test_staging_round_trips_mixed_dtypes_and_reuses_its_buffers():
    staging = HostStaging("cpu")
    arrays = [("a", torch.int32, [1, -2, 3], (3,)), ("b", torch.int64, [2**40, -7], (2,)),
              ("c", torch.int32, [5, 6, 7, 8, 9, 10], (2, 3)), ("d", torch.int64, [], (0,)),
              ("e", torch.float32, [0.5, -1.25], (2,))]
    views = staging.upload(arrays)
    for name, dtype, values, shape in arrays:
        assert views[name].dtype == dtype and tuple(views[name].shape) == shape
        assert views[name].flatten().tolist() == values
    # every view 16 bytes from the buffer's start, whatever the lengths before it (Triton's pointer specialisation)
    base = staging.buffers.dev.data_ptr()
    assert all((views[name].data_ptr() - base) % 16 == 0 for name, *_ in arrays)
    buffer = staging.buffers.dev
    again = staging.upload([("x", torch.int64, [3, 4], (2,))])
    assert again["x"].tolist() == [3, 4] and staging.buffers.dev is buffer and staging.num_copies == 2


def test_a_repeated_layout_reuses_its_views_with_the_new_values():
    staging = HostStaging("cpu")
    first = staging.upload([("ids", torch.int64, [5, 6, 7], (3,)), ("w", torch.float32, [0.5], (1, 1))])
    again = staging.upload([("ids", torch.int64, [8, 9, 10], (3,)), ("w", torch.float32, [1.5], (1, 1))])
    assert again is first and again["ids"].tolist() == [8, 9, 10] and again["w"].tolist() == [[1.5]]
    other = staging.upload([("ids", torch.int64, [1, 2], (2,)), ("w", torch.float32, [2.5], (1, 1))])
    assert other is not first and other["ids"].tolist() == [1, 2] and other["w"].tolist() == [[2.5]]


def test_build_matches_the_per_field_tensors():
    q, c, slots, tables = [3, 1, 2], [0, 5, 4], [2, 0, 1], [[4], [1, 2], [3, 5, 6]]
    batch = ForwardBatch.build(q, c, slots, tables, 4, "cpu")
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.cu_seqlens.dtype == torch.int32
    assert batch.slot_mapping.tolist() == [16, 17, 18, 9, 20, 21] and batch.slot_mapping.dtype == torch.int64
    assert batch.state_slots_t.tolist() == slots and batch.state_slots_t.dtype == torch.int64
    assert batch.block_tables_t.tolist() == [[4, 0, 0], [1, 2, 0], [3, 5, 6]]
    assert batch.seq_lens_t.tolist() == [3, 6, 6] and batch.positions.tolist() == [0, 1, 2, 5, 4, 5]
    assert batch.token_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert all(getattr(batch, f).device.type == "cpu" for f in TENSOR_FIELDS)


@pytest.fixture(scope="module")
def llm():
    return flashinfra.LLM(None, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=64,
                          prefix_cache_slots=0)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True,
                                                   logprobs=2)])
def test_a_decode_step_makes_one_upload_and_no_other_device_tensor(llm, monkeypatch, params):
    runner = llm.engine.runner
    made = []  # torch.tensor calls from the step's preparation (runner, batch, staging) and sampling
    real_tensor = torch.tensor
    prep = {"flashinfra.engine.runner", "flashinfra.model.forward_batch", "flashinfra.model.staging",
            "flashinfra.engine.sampler"}

    def counting(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") in prep:
            made.append(kwargs.get("device"))
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    steps = []
    real_launch = runner.launch

    def launch(plan, prev=None):
        before, made_before = runner.staging.num_copies, len(made)
        out = real_launch(plan, prev)
        steps.append((plan, runner.staging.num_copies - before, len(made) - made_before))
        return out

    monkeypatch.setattr(runner, "launch", launch)
    llm.generate([[5, 6, 7, 8, 9], [11, 12, 13]], [params, params])
    decodes = [(copies, tensors) for plan, copies, tensors in steps
               if plan.scheduled and all(sr.num_new_tokens == 1 and sr.context_len > 0 for sr in plan.scheduled)]
    assert len(decodes) >= 3
    assert all(copies == 1 and tensors == 0 for copies, tensors in decodes), decodes
