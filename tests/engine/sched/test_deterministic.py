"""The scheduler in deterministic mode: prompt pieces cut at KDA chunk boundaries whatever the budget, prefix
hits on them, and generated tokens recomputed one a step after a preemption (the decode arithmetic they first
ran through)."""

from __future__ import annotations

import random

from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.engine.sched.request import Request
from flashinfra.engine.sched.scheduler import Scheduler
from tests.engine.sched.sim import VOCAB, SimRunner, expected_output, make_request, run_all, sched_config


def test_deterministic_mode_cuts_prompts_at_kda_chunks():
    """Deterministic mode: every prompt piece starts at a multiple of the KDA chunk, ends at one or at the prompt's
    end, and a piece on a cached state has at least 2 prompt tokens, whatever the budget, prefix hits and batch."""
    from flashinfra.engine.sched.aligned import DETERMINISTIC_ALIGN as A

    pieces = []

    class Recording(SimRunner):
        def execute(self, plan, limits):
            pieces.extend((sr.context_len, sr.num_new_tokens, len(sr.prompt_token_ids), sr.load_state_from)
                          for sr in plan.scheduled)
            return super().execute(plan, limits)

    rng = random.Random(12)
    system = [rng.randrange(8, VOCAB) for _ in range(150)]
    first = [Request(f"a{i}", system[: rng.randrange(60, 150)] + [rng.randrange(8, VOCAB) for _ in
                                                                  range(rng.randrange(1, 140))],
                     SamplingParams(max_tokens=rng.randrange(1, 6)), 0.0) for i in range(10)]
    second = [Request(f"b{i}", list(r.prompt_token_ids[: len(r.prompt_token_ids) - i % 3]), r.sampling, 0.0)
              for i, r in enumerate(first)]
    truth = {r.request_id: expected_output(r) for r in first + second}
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=150, max_model_len=512, deterministic=True)
    sched = Scheduler(cfg, HybridCacheManager(2000, 16, 4, 8, checkpoint_interval=100, align=A))
    outputs, _, sched = run_all(None, cfg, 2000, 16, 4, num_prefix_slots=8, waves=[first, second], sched=sched,
                                runner=Recording(2000, 16, 4, 8))
    assert outputs == truth
    assert sched.num_prefix_hit_tokens_total > 0
    prompt_pieces = [(c, n, p, load) for c, n, p, load in pieces if c < p]
    assert any(c > 0 for c, _, _, _ in prompt_pieces)
    for c, n, p, load in prompt_pieces:
        assert c % A == 0 and (c + n == p or (c + n) % A == 0), (c, n, p)
        assert c == 0 or n >= 2, (c, n, p)


def test_deterministic_mode_recomputes_generated_tokens_one_a_step():
    """After a preemption, deterministic mode runs the prompt in aligned pieces up to its end, then each generated
    token alone (the decode arithmetic it first ran through)."""
    pieces = []

    class Recording(SimRunner):
        def execute(self, plan, limits):
            pieces.extend((sr.context_len, sr.num_new_tokens, len(sr.prompt_token_ids)) for sr in plan.scheduled)
            return super().execute(plan, limits)

    rng = random.Random(13)
    reqs = [make_request(f"r{i}", rng.randrange(60, 200), rng.randrange(20, 40), rng) for i in range(6)]
    truth = {r.request_id: expected_output(r) for r in reqs}
    cfg = sched_config(max_num_seqs=6, max_num_batched_tokens=128, max_model_len=512, deterministic=True)
    sched = Scheduler(cfg, HybridCacheManager(60, 16, 6, 0, align=64))
    outputs, _, sched = run_all(None, cfg, 60, 16, 6, sched=sched, runner=Recording(60, 16, 6), waves=[reqs])
    assert outputs == truth and sched.num_preemptions_total > 0
    assert all(n == 1 for c, n, p in pieces if c >= p)
    assert all(c + n <= p for c, n, p in pieces if c < p)
