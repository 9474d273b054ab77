"""The batch's grammar mask: filled in the background into the constrained rows only (JSON rows, other grammars,
rows still reasoning, in an order of their own; in chunks on several threads), it masks each row as that row's mask
made alone does, leaves the free rows and the failed rows' logits alone, and applies to a subset of the rows (a row
sampled alone)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from flashinfra.engine import grammar
from flashinfra.engine.grammar import FILL_THREADS_MAX, GrammarRuntime, fill_threads
from flashinfra.engine.sched.messages import GrammarSpec

EOS = [4069, 4076, 4078]
V = 4096
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
          "required": ["name"], "additionalProperties": False}
SPECS = [None, GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", r"[a-z]{1,8} \d{2}"), None,
         GrammarSpec("json_schema", json.dumps(SCHEMA), after_think=True), GrammarSpec("choice", '["yes", "no"]'),
         GrammarSpec("json_object")]
BAD = 5  # the choice row: its first token starts none of the choices


def _runtime() -> GrammarRuntime:
    from flashinfra.model.factory import default_model_dir

    return GrammarRuntime.for_model(default_model_dir(), V, EOS)


@pytest.fixture(scope="module")
def runtimes():
    return _runtime(), _runtime()


def _masked(runtime, rows, logits, batch_rows=None):
    mask = runtime.prepare(rows)
    out = logits.clone()
    if mask is not None:
        mask.apply(out, batch_rows)
    return out, mask


def test_batch_mask_equals_each_row_alone(runtimes, monkeypatch):
    monkeypatch.setattr(grammar, "fill_threads", lambda rows, words: min(rows, 3))  # chunks on helper threads
    batch, alone = runtimes
    gen = torch.Generator().manual_seed(0)
    specs = list(SPECS)
    outs: list[list[int]] = [[] for _ in specs]
    outs[BAD] = [4087]  # <tool_call>: no choice starts with it
    ids = [f"m{b}" for b in range(len(specs))]
    for step in range(12):
        logits = torch.randn(len(specs), V, generator=gen)
        logits[:, EOS] -= 50.0
        if step == 3:
            logits[4, alone.think_end_id] += 100.0  # row 4 ends its reasoning
        rows = [(ids[b], specs[b], outs[b]) for b in range(len(specs))]
        got, mask = _masked(batch, rows, logits)
        assert set(mask.errors) == {BAD} and "grammar" in mask.errors[BAD]
        assert sorted(mask.rows) == [b for b, spec in enumerate(specs) if spec is not None and b != BAD]
        for b, spec in enumerate(specs):
            if spec is None or b == BAD:  # free or failed: untouched, bit for bit
                assert torch.equal(got[b].view(torch.int32), logits[b].view(torch.int32)), b
                continue
            want, _ = _masked(alone, [(ids[b], spec, outs[b])], logits[b : b + 1])
            assert torch.equal(got[b], want[0]), (step, b)
            assert torch.isinf(got[b]).any(), (step, b)
            sub, _ = _masked(batch, rows, logits[b : b + 1], batch_rows=[b])
            assert torch.equal(sub[0], want[0]), (step, b)
        for b in range(len(specs)):
            if b != BAD:
                outs[b].append(int(got[b].argmax()))
                if outs[b][-1] in EOS:  # finished: free from the next step on
                    specs[b] = None
                    batch.release([ids[b]])
                    alone.release([ids[b]])
    assert alone.think_end_id in outs[4]
    assert sum(spec is not None for spec in specs) >= 2  # some rows stayed constrained throughout
    batch.release(ids)
    alone.release(ids)
    assert batch.num_tracked == alone.num_tracked == 0


def test_prepare_returns_before_the_fill_ends():
    runtime = _runtime()
    gate, fill = threading.Event(), runtime._fill

    def held(*args):
        gate.wait(10)
        return fill(*args)

    runtime._fill = held
    start = time.perf_counter()
    with torch.inference_mode():  # as the runner's step: the buffers are inference tensors
        mask = runtime.prepare([("r", GrammarSpec("json_object"), [])])
        assert mask is not None and time.perf_counter() - start < 5  # the fill is held for 10 s
        gate.set()
        logits = torch.zeros(1, V)
        mask.apply(logits)
    assert mask.rows == [0] and 0 < int(torch.isfinite(logits).sum()) < 10  # tokens opening an object
    runtime.release(["r"])


def test_fill_threads():
    assert fill_threads(1, 4840) == 1
    assert fill_threads(64, V // 32) == 1  # the built-in model's batch: one thread's work
    assert 1 <= fill_threads(64, 4840) <= FILL_THREADS_MAX
    assert fill_threads(10**6, 4840) <= FILL_THREADS_MAX
