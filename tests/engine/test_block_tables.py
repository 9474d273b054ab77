"""``BlockTables`` against the scheduler's own lists, through preemptions and prefix-cache hits (which replace a
request's blocks), and ``ForwardBatch.host_arrays`` against its definition token by token."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flashinfra.engine.block_tables import BlockTables
from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.engine.sched.request import Request
from flashinfra.model.forward_batch import ForwardBatch
from tests.engine.sched.sim import VOCAB, SimRunner, expected_output, make_request, run_all, sched_config


class MirroredRunner(SimRunner):
    """The simulated runner, also keeping every request's table in ``BlockTables`` as the model runner does: each
    step's arrays must equal the plan's lists, and every array handed out earlier must be unchanged. Unlike the model
    runner it keeps a preempted request's array, so the request's return with new blocks exercises the rebuild that
    ``blocks_epoch`` triggers."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.tables = BlockTables()
        self.handed: list[tuple[np.ndarray, np.ndarray]] = []
        self.rebuilt = 0

    def execute(self, plan, limits):
        self.tables.drop(plan.finished_ids)
        for sr in plan.scheduled:
            before = self.tables._rows.get(sr.request_id)
            table = self.tables.table(sr)
            self.rebuilt += before is not None and before[0] != sr.blocks_epoch
            assert table.dtype == np.int32 and table.tolist() == list(sr.block_table)
            self.handed.append((table, table.copy()))
        assert all(np.array_equal(a, copy) for a, copy in self.handed)
        return super().execute(plan, limits)


@pytest.mark.parametrize("num_blocks", [400, 30])
def test_tables_follow_the_lists_through_preemption_and_prefix_hits(num_blocks):
    rng = random.Random(3)
    system = [rng.randrange(8, VOCAB) for _ in range(21)]
    first = [make_request(f"a{i}", 0, rng.randrange(2, 30), rng) for i in range(6)]
    for r in first:
        r.prompt_token_ids = system + [rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 40))]
        r.__post_init__()
    second = [Request(f"b{i}", list(r.prompt_token_ids), SamplingParams(max_tokens=20), 0.0)
              for i, r in enumerate(first)]
    truth = {r.request_id: expected_output(r) for r in first + second}
    cfg = sched_config(max_num_seqs=6, max_num_batched_tokens=40, max_model_len=256)
    runner = MirroredRunner(num_blocks, 4, 6, 8)
    outputs, _, sched = run_all(None, cfg, num_blocks, 4, 6, num_prefix_slots=8, waves=[first, second],
                                runner=runner)
    assert outputs == truth
    assert len(runner.handed) > 100
    if num_blocks == 400:  # the repeated prompts start from the prefix cache's blocks
        assert sched.num_prefix_hit_tokens_total > 0
    else:  # preempted requests come back with new blocks: their arrays are rebuilt
        assert sched.num_preemptions_total > 0 and runner.rebuilt > 0
    runner.execute(sched.schedule(), cfg)  # the plan after the last step reports the last finished requests
    assert len(runner.tables) == 0  # every finished request's array was dropped


def reference_arrays(query_lens, context_lens, block_tables, bs):
    """``host_arrays``' slot mapping, token rows and positions, token by token."""
    slots, seq, pos = [], [], []
    for b, (q, c, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        for p in range(c, c + q):
            slots.append(int(table[p // bs]) * bs + p % bs)
            seq.append(b)
            pos.append(p)
    return slots, seq, pos


@pytest.mark.parametrize("seed", range(4))
def test_host_arrays_match_the_definition(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    B = rng.randrange(1, 9)
    q = [rng.choice([1, 1, rng.randrange(1, 40)]) for _ in range(B)]
    c = [rng.randrange(0, 100) for _ in range(B)]
    tables = [rng.sample(range(5000), -(-(c[b] + q[b]) // bs) + rng.randrange(0, 3)) for b in range(B)]
    as_arrays = [np.asarray(t, dtype=np.int32) for t in tables]
    for given in (tables, as_arrays):
        arrays = {name: (dtype, np.asarray(values), shape)
                  for name, dtype, values, shape in ForwardBatch.host_arrays(q, c, list(range(B)), given, bs)}
        slots, seq, pos = reference_arrays(q, c, tables, bs)
        assert arrays["slot_mapping"][1].tolist() == slots and arrays["slot_mapping"][0] == torch.int64
        assert arrays["token_seq"][1].tolist() == seq and arrays["positions"][1].tolist() == pos
        assert arrays["cu_seqlens"][1].tolist() == [0, *np.cumsum(q).tolist()]
        assert arrays["seq_lens_t"][1].tolist() == [a + b for a, b in zip(c, q)]
        width = max(len(t) for t in tables)
        assert arrays["block_tables_t"][2] == (B, width)
        assert arrays["block_tables_t"][1].tolist() == [x for t in tables for x in (*t, *[0] * (width - len(t)))]
    with pytest.raises(ValueError, match="do not fit"):
        ForwardBatch.host_arrays([5], [0], [0], [[1]], 4)
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardBatch.host_arrays([0], [3], [0], [[1]], 4)
