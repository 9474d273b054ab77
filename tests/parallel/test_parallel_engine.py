"""The engine over spawned CPU gloo ranks: greedy generation through ``LLM(tensor_parallel_size=...)``
equals one rank's, a bad world size is refused before any process starts, and a killed rank fails the
next requests with a clear error instead of hanging."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.layout import LayoutError

ENGINE = dict(num_blocks=128, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, device="cpu",
              dtype="float32")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp_engine"), seed=1)


def _prompts():
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 512) for _ in range(n)] for n in (13, 5, 21)]
    return prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(ckpt):
    prompts, params = _prompts()
    llm = flashinfra.LLM(ckpt, **ENGINE)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (1, 2)])
def test_greedy_generation_equals_one_rank(ckpt, reference, tp, ep):
    prompts, params = _prompts()
    llm = flashinfra.LLM(ckpt, tensor_parallel_size=tp, expert_parallel_size=ep, dist_timeout_s=30, **ENGINE)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    finally:
        llm.engine.close()


def test_world_size_that_does_not_divide_heads_is_refused(ckpt):
    with pytest.raises(LayoutError, match="is not divisible by 3"):
        flashinfra.LLM(ckpt, tensor_parallel_size=3, **ENGINE)


def test_killed_rank_fails_requests_with_a_clear_error(ckpt):
    prompts, params = _prompts()
    llm = flashinfra.LLM(ckpt, tensor_parallel_size=2, dist_timeout_s=20, **ENGINE)
    try:
        worker = llm.engine.workers[1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        start = time.monotonic()
        outs = llm.generate(prompts, params)
        assert time.monotonic() - start < 30
        assert all(o.finish_reason == "error" for o in outs), [o.finish_reason for o in outs]
        assert "rank 1" in outs[0].error and "exited" in outs[0].error
    finally:
        llm.engine.close()
