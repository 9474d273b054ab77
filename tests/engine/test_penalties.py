"""Penalties from counts kept on the device (``engine/penalties.py``) give what the rows' token lists give:
``PenaltyStep`` against the direct computation over many steps (rows reused, grown, rebuilt, tokens counted from
the host), and whole generations against the same engine sampling penalized rows from the lists, synchronous and
asynchronous, with preemption, prefix hits and chunked prefill; and a penalized step no longer stops the engine
from scheduling ahead."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import flashinfra
from flashinfra import SamplingParams
from flashinfra.engine.penalties import PenaltyRows, PenaltyStep
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.model.staging import HostStaging
from tests.engine.test_async_scheduling import assert_same, count_ahead
from tests.engine.test_sampler import ref_penalties

V = 97


@dataclass
class Row:  # the fields of a ScheduledRequest that PenaltyRows reads
    request_id: str
    sampling: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    context_len: int
    num_new_tokens: int


def test_rows_follow_the_token_lists_over_many_steps():
    """Random requests come and go over 40 steps (more at once than the first allocation holds), their tokens
    sampled on the device, appended on the host one step late (a step in flight) or several at once (accepted
    drafts), one cut back; each step's penalized logits equal the direct computation on fresh logits."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    rows, staging = PenaltyRows(V, torch.device("cpu")), HostStaging("cpu")
    live: dict[str, dict] = {}
    for step in range(40):
        for _ in range(rng.randrange(0, 4)):
            rid = f"r{step}-{len(live)}"
            live[rid] = dict(params=SamplingParams(repetition_penalty=rng.choice([1.0, 0.7, 1.6]),
                                                   frequency_penalty=rng.choice([0.0, 0.4]),
                                                   presence_penalty=rng.choice([0.0, -0.3, 0.9])),
                             prompt=[rng.randrange(V) for _ in range(rng.randrange(1, 30))], out=[], pending=[])
        gone = [r for r in live if rng.random() < 0.1]
        rows.release(gone)
        for r in gone:
            del live[r]
        cut = next((r for r in live if live[r]["out"] and not live[r]["pending"] and rng.random() < 0.05), None)
        if cut is not None:
            del live[cut]["out"][-1]
        batch = [Row(r, d["params"], d["prompt"], d["out"], 0, len(d["prompt"]) + len(d["out"]) + len(d["pending"]))
                 for r, d in live.items()]
        # the full sequence each row's penalties must see: the host's tokens and those still in flight
        want_out = [d["out"] + d["pending"] for d in live.values()]
        x = torch.randn(len(batch), V, generator=gen) * 3
        penalties = PenaltyStep.of(rows, staging.upload(rows.columns(batch)))
        got = x.clone()
        if penalties is not None:
            penalties.apply(got)
        for i, (row, out) in enumerate(zip(batch, want_out)):
            want = ref_penalties(x[i].tolist(), row.sampling, row.prompt_token_ids, out)
            assert got[i].tolist() == pytest.approx(want, abs=1e-5), (step, row.request_id)
        tokens = torch.randint(V, (len(batch),), generator=gen)
        if penalties is not None:
            penalties.count(tokens)
        for d, t in zip(live.values(), tokens.tolist()):
            d["out"] += d["pending"]  # the step in flight's token reaches the host
            d["pending"] = [t]
            if rng.random() < 0.1:  # drafts accepted beside it: on the host only
                d["out"] += d["pending"] + [rng.randrange(V) for _ in range(2)]
                d["pending"] = []
    assert rows.counts.shape[0] > 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def from_lists(monkeypatch):
    """Every penalized row sampled from its token lists (``sample``), as before the device counts."""
    monkeypatch.setattr(PenaltyRows, "columns", lambda self, sampled: [])


def workload(seed: int, n: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randrange(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                             seed=None if i % 2 else i, logprobs=2 if i % 3 == 0 else None,
                             repetition_penalty=[1.0, 1.3, 0.8][i % 3], frequency_penalty=[0.5, 0.0][i % 2],
                             presence_penalty=[0.0, 0.0, 0.7, -0.4][i % 4])
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("engine", [dict(), dict(async_scheduling=True), dict(num_blocks=24),
                                    dict(max_num_batched_tokens=16, async_scheduling=True)],
                         ids=["sync", "async", "preemption", "chunked-async"])
def test_generation_equals_penalties_from_the_lists(ckpt, monkeypatch, engine):
    args = {**dict(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32"),
            **engine}
    prompts, params = workload(3, 14)
    prompts += [prompts[0] + [5, 6, 7]] * 2  # prefix hits
    params += [SamplingParams(max_tokens=9, repetition_penalty=1.5, frequency_penalty=0.3, ignore_eos=True)] * 2
    llm = flashinfra.LLM(ckpt, **args)
    got = llm.generate(prompts, params)
    with monkeypatch.context() as m:  # the lists' path is synchronous: a host-sampled step cannot be run ahead of
        from_lists(m)
        want = flashinfra.LLM(ckpt, **{**args, "async_scheduling": False}).generate(prompts, params)
    # on a GPU a row's float32 logits move with the batch beside it by more than on a CPU (TF32 matmuls), and the
    # asynchronous engine batches differently
    assert_same(got, want, logprob_abs=1e-4 if llm.engine.model.device.type == "cpu" else 3e-2)
    llm.generate([[1, 2]], SamplingParams(max_tokens=1))  # its step frees the rows of the requests done before it
    assert not llm.engine.runner.penalties.held
    if engine.get("num_blocks") == 24:
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_penalized_steps_are_scheduled_ahead(ckpt, monkeypatch):
    llm = flashinfra.LLM(ckpt, num_blocks=256, block_size=4, max_num_seqs=8, dtype="float32", async_scheduling=True)
    ahead = count_ahead(llm, monkeypatch)
    prompts, params = workload(4, 6)
    llm.generate(prompts, params)
    assert sum(ahead) > 10
