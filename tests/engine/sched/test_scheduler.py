"""Scheduler + hybrid cache manager, driven by the simulated model of ``sim.py`` that checks every cache address
it is given: batching, preemption, prefix caching, chunked prefill, stops, limits, aborts and errors, and random
workloads that must keep every output and free everything."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.engine.sched.plan import StepResult
from flashinfra.engine.sched.request import Request
from flashinfra.engine.sched.scheduler import Scheduler
from tests.engine.sched.sim import VOCAB, SimRunner, expected_output, make_request, next_token, run_all, sched_config

def test_mixed_batch_matches_sequential_truth():
    rng = random.Random(0)
    reqs = [make_request(f"r{i}", rng.randrange(1, 90), rng.randrange(1, 20), rng) for i in range(40)]
    truth = {r.request_id: expected_output(r) for r in reqs}
    cfg = sched_config(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    outputs, reasons, sched = run_all(reqs, cfg, num_blocks=400, block_size=4, num_slots=8)
    assert outputs == truth
    assert all(reasons[r.request_id] == "length" for r in reqs)
    assert sched.num_preemptions_total == 0


def test_tiny_cache_forces_preemption_and_keeps_outputs():
    rng = random.Random(1)
    reqs = [make_request(f"r{i}", rng.randrange(5, 40), rng.randrange(10, 30), rng) for i in range(24)]
    truth = {r.request_id: expected_output(r) for r in reqs}
    cfg = sched_config(max_num_seqs=16, max_num_batched_tokens=48, max_model_len=128)
    outputs, _, sched = run_all(reqs, cfg, num_blocks=24, block_size=4, num_slots=16)
    assert outputs == truth
    assert sched.num_preemptions_total > 0
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions_total


@pytest.mark.parametrize("num_blocks", [400, 30])
def test_prefix_cache_hits_are_token_exact(num_blocks):
    """Shared system prompts, repeated prompts and multi-turn continuations hit the prefix cache; outputs
    are those of a cold run, and the simulated KDA slot checks that the loaded state is the right one."""
    rng = random.Random(9)
    system = [rng.randrange(8, VOCAB) for _ in range(21)]
    first = [make_request(f"a{i}", 0, rng.randrange(2, 8), rng) for i in range(6)]
    for r in first:
        r.prompt_token_ids = system + [rng.randrange(8, VOCAB) for _ in range(rng.randrange(1, 9))]
        r.__post_init__()
    truth = {r.request_id: expected_output(r) for r in first}
    second = []
    for i, r in enumerate(first):  # repeat each prompt, and continue each conversation
        again = Request(f"b{i}", list(r.prompt_token_ids), r.sampling, 0.0)
        turn = Request(f"c{i}", r.prompt_token_ids + truth[r.request_id] + [11, 12, 13], SamplingParams(max_tokens=4),
                       0.0)
        second += [again, turn]
    truth.update({r.request_id: expected_output(r) for r in second})
    cfg = sched_config(max_num_seqs=6, max_num_batched_tokens=40, max_model_len=256)
    outputs, _, sched = run_all(None, cfg, num_blocks, 4, 6, num_prefix_slots=8, waves=[first, second])
    assert outputs == truth
    assert sched.num_prefix_hit_tokens_total >= 12 * 4
    if num_blocks == 30:  # small enough that hits and preemptions mix
        assert sched.num_preemptions_total > 0


def test_a_cached_prefix_hits_only_token_for_token():
    """A prefix entry shares the caching request's token list (no copy); a request whose block hashes match it but
    whose tokens differ (a hash collision, forced here) gets no hit, and the entry's prefix is not changed by the
    tokens its request appends later."""
    cache = HybridCacheManager(64, 4, 2, num_prefix_slots=2, checkpoint_interval=8)
    owner = Request("a", list(range(20, 40)), SamplingParams(max_tokens=4), 0.0)
    assert cache.try_allocate(owner, 16)
    slot = cache.reserve_checkpoint_slot()
    cache.register_prefix(owner, 16, slot)
    owner.append_output(7)  # the entry's list grows; its first 16 tokens do not change
    same = Request("b", list(range(20, 36)) + [1, 2], SamplingParams(max_tokens=4), 0.0)
    other = Request("c", list(range(20, 35)) + [99, 1, 2], SamplingParams(max_tokens=4), 0.0)
    other._block_hashes = (4, same.block_hashes(4))  # the colliding hashes
    hit = cache.match_prefix(same)
    assert hit is not None and hit.length == 16 and hit.source is owner.all_token_ids
    assert cache.match_prefix(other) is None


def test_one_step_saves_every_checkpoint_it_crosses_while_slots_last():
    """Only the token budget cuts a step: a 3000-token prompt runs in one step that saves its checkpoints at 1024,
    2048 and its last block boundary (2992), each registered after the step with its own blocks; without a free
    slot a checkpoint is skipped; an aborted step's slots go back."""
    cfg = sched_config(max_num_seqs=2, max_num_batched_tokens=4096, max_model_len=8192)
    rng = random.Random(4)
    for num_prefix_slots, want in ((4, [1024, 2048, 2992]), (2, [1024, 2048])):
        cache = HybridCacheManager(400, 16, 2, num_prefix_slots, checkpoint_interval=1024)
        sched = Scheduler(cfg, cache)
        req = make_request("a", 3000, 1, rng)
        sched.add_request(req)
        plan = sched.schedule()
        (sr,) = plan.scheduled
        assert sr.num_new_tokens == 3000 and [p for p, _ in sr.save_states] == want
        sched.update(plan, StepResult(sampled={"a": 1}))
        entries = sorted(cache._prefixes.values(), key=lambda e: e.length)
        assert [e.length for e in entries] == want
        assert all(e.block_ids.tolist() == entries[-1].block_ids[: e.length // 16].tolist() for e in entries)
        assert [e.slot for e in entries] == [slot for _, slot in sr.save_states]
    cache = HybridCacheManager(400, 16, 2, 4, checkpoint_interval=1024)
    sched = Scheduler(cfg, cache)
    sched.add_request(make_request("b", 3000, 1, rng))
    plan = sched.schedule()
    sched.abort(["b"])
    sched.update(plan, StepResult())
    assert cache.num_cached_prefixes == 0 and cache._prefix_slots.num_free == 4


def test_checkpoint_interval_lets_a_shared_system_prompt_hit():
    rng = random.Random(11)
    system = [rng.randrange(8, VOCAB) for _ in range(19)]

    def with_suffix(rid):
        return Request(rid, system + [rng.randrange(8, VOCAB) for _ in range(rng.randrange(3, 9))],
                       SamplingParams(max_tokens=3), 0.0)

    hits = {}
    for interval in (1024, 8):
        waves = [[with_suffix(f"{interval}-{w}")] for w in range(4)]
        truth = {r.request_id: expected_output(r) for w in waves for r in w}
        cfg = sched_config(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
        outputs, _, sched = run_all(None, cfg, 64, 4, 2, num_prefix_slots=8, waves=waves,
                                    sched=Scheduler(cfg, HybridCacheManager(64, 4, 2, 8, interval)))
        assert outputs == truth
        hits[interval] = sched.num_prefix_hit_tokens_total
    assert hits[1024] == 0  # each prompt's own end is past the shared part
    assert hits[8] == 3 * 16  # later requests start after the shared checkpoint at 16 tokens


def test_prefix_cache_evicts_before_preempting():
    rng = random.Random(10)
    cfg = sched_config(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    cache = HybridCacheManager(12, 4, 2, num_prefix_slots=4)
    sched = Scheduler(cfg, cache)
    runner = SimRunner(12, 4, 2, 4)
    waves = [[make_request(f"w{i}", 9, 2, rng)] for i in range(4)]  # each leaves a cached 8-token prefix
    run_all(None, cfg, 12, 4, 2, sched=sched, runner=runner, waves=waves)
    big = make_request("big", 30, 10, rng)
    outputs, _, _ = run_all(None, cfg, 12, 4, 2, sched=sched, runner=runner, waves=[[big]])
    assert outputs["big"] == expected_output(big) and sched.num_preemptions_total == 0


def test_chunked_prefill_respects_budget_and_chunk_cap():
    rng = random.Random(2)
    long = make_request("long", 300, 3, rng)
    short = make_request("short", 5, 3, rng)
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, max_prefill_chunk=40)
    sched = Scheduler(cfg, HybridCacheManager(200, 16, 4))
    runner = SimRunner(200, 16, 4)
    sched.add_request(long)
    sched.add_request(short)
    plan = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled] == [("long", 40, False),
                                                                                    ("short", 5, True)]
    sched.update(plan, runner.execute(plan, cfg))
    plan = sched.schedule()
    assert [(s.request_id, s.context_len, s.num_new_tokens) for s in plan.scheduled] == [("long", 40, 40),
                                                                                         ("short", 5, 1)]


def test_stop_tokens_eos_and_ignore_eos():
    rng = random.Random(3)
    base = make_request("a", 10, 50, rng)
    first = expected_output(base)
    stop_at = first[3]
    reqs = [
        Request("stop", base.prompt_token_ids, SamplingParams(max_tokens=50, stop_token_ids=(stop_at,)), 0.0),
        Request("eos", base.prompt_token_ids, SamplingParams(max_tokens=50), 0.0, eos_token_ids=frozenset({stop_at})),
        Request("ign", base.prompt_token_ids, SamplingParams(max_tokens=50, ignore_eos=True), 0.0,
                eos_token_ids=frozenset({stop_at})),
    ]
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    outputs, reasons, _ = run_all(reqs, cfg, num_blocks=100, block_size=8, num_slots=4)
    k = first.index(stop_at) + 1
    assert outputs["stop"] == first[:k] and reasons["stop"] == "stop"
    assert outputs["eos"] == first[:k] and reasons["eos"] == "stop"
    assert outputs["ign"] == first and reasons["ign"] == "length"


def test_max_model_len_and_cache_capacity_limit_generation():
    rng = random.Random(4)
    req = make_request("a", 20, 100, rng)
    cfg = sched_config(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=1000)
    outputs, reasons, _ = run_all([req], cfg, num_blocks=8, block_size=4, num_slots=2)  # capacity 32 tokens
    assert len(outputs["a"]) == 12 and reasons["a"] == "length"
    sched = Scheduler(cfg, HybridCacheManager(8, 4, 2))
    with pytest.raises(ValueError, match="limit is 31"):
        sched.add_request(make_request("b", 32, 1, rng))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("c", [], SamplingParams(), 0.0))
    sched.add_request(make_request("d", 3, 1, rng))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("d", 3, 1, rng))


def test_abort_frees_at_once_waiting_and_running():
    rng = random.Random(5)
    cfg = sched_config(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(cfg, HybridCacheManager(50, 4, 1))
    runner = SimRunner(50, 4, 1)
    a, b = make_request("a", 10, 20, rng), make_request("b", 10, 20, rng)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    assert [s.request_id for s in plan.scheduled] == ["a"]  # batch-size cap 1
    sched.update(plan, runner.execute(plan, cfg))
    assert sched.cache.num_free_blocks < 50 and sched.cache.num_free_slots == 0
    outs = sched.abort(["a", "b", "unknown"])
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort"), ("b", True, "abort")]
    assert sched.cache.num_free_blocks == 50 and sched.cache.num_free_slots == 1
    assert not sched.has_unfinished()
    assert sched.schedule().finished_ids == ["a", "b"]
    assert sched.abort(["a"]) == []


def test_error_fails_only_that_request():
    rng = random.Random(6)
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(cfg, HybridCacheManager(50, 4, 4))
    runner = SimRunner(50, 4, 4)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 5, 3, rng))
    plan = sched.schedule()
    result = runner.execute(plan, cfg)
    result.errors["a"] = "sampling failed"
    outs = {o.request_id: o for o in sched.update(plan, result)}
    assert outs["a"].finish_reason == "error" and outs["a"].error == "sampling failed"
    assert not outs["b"].finished and len(outs["b"].new_token_ids) == 1
    assert [r.request_id for r in sched.running] == ["b"]


def test_stats_report_usage():
    rng = random.Random(7)
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(cfg, HybridCacheManager(10, 4, 4))
    sched.add_request(make_request("a", 9, 3, rng))
    sched.add_request(make_request("b", 2, 3, rng))
    sched.schedule()
    st = sched.stats()
    assert (st.num_running, st.num_waiting, st.num_blocks_total, st.num_blocks_free) == (2, 0, 10, 6)
    assert st.cache_usage == pytest.approx(0.4) and st.state_slot_usage == pytest.approx(0.5)


def test_events_hook_receives_queue_waits_and_preemptions():
    class Sink:
        def __init__(self):
            self.events = []

        def emit(self, kind, **fields):
            self.events.append((kind, fields))

    rng = random.Random(8)
    sink = Sink()
    cfg = sched_config(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    sched = Scheduler(cfg, HybridCacheManager(6, 4, 4), events=sink, clock=lambda: 10.0)
    runner = SimRunner(6, 4, 4)
    for i in range(3):
        r = make_request(f"r{i}", 6, 10, rng)
        r.arrival_time = 9.5
        sched.add_request(r)
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan, cfg))
    kinds = [k for k, _ in sink.events]
    assert "preempt" in kinds
    waits = [f["wait_s"] for k, f in sink.events if k == "queue_wait"]
    assert len(waits) == 3 and all(w == pytest.approx(0.5) for w in waits)


def test_scheduler_imports_no_torch():
    code = (
        "import sys; import flashinfra.engine.sched.scheduler, flashinfra.engine.sched.cache_manager, "
        "flashinfra.engine.sched.plan, flashinfra.engine.sched.request, flashinfra.engine.sched.messages, "
        "flashinfra.engine.config, flashinfra.engine.sched.checks; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(10, 60),
    block_size=st.integers(1, 8),
    num_slots=st.integers(1, 6),
    prefix_slots=st.integers(0, 4),
    interval=st.integers(1, 20),
    budget=st.integers(8, 64),
    chunk=st.integers(0, 24),
    shapes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.booleans()), min_size=1, max_size=12),
    aborts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 11)), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_outputs_and_free_everything(num_blocks, block_size, num_slots, prefix_slots, interval,
                                                           budget, chunk, shapes, aborts, seed):
    """Any cache size, budget and chunk cap, with shared prefixes and aborts at random steps: every request
    that is not aborted gets exactly its cold-run tokens, aborted ones a prefix of them, and everything is
    freed at the end."""
    rng = random.Random(seed)
    capacity = num_blocks * block_size
    shared = [rng.randrange(8, VOCAB) for _ in range(16)]
    reqs = []
    for i, (plen, max_tokens, share) in enumerate(shapes):
        plen = min(plen, capacity - 1)
        prompt = (shared + [rng.randrange(8, VOCAB) for _ in range(plen)])[:plen] if share else \
            [rng.randrange(8, VOCAB) for _ in range(plen)]
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0))
    cfg = sched_config(max_num_seqs=num_slots, max_num_batched_tokens=budget, max_model_len=capacity,
                          max_prefill_chunk=chunk)
    sched = Scheduler(cfg, HybridCacheManager(num_blocks, block_size, num_slots, prefix_slots, interval))
    runner = SimRunner(num_blocks, block_size, num_slots, prefix_slots)
    for r in reqs:
        sched.add_request(r)
    truth = {}
    for r in reqs:
        toks, out = list(r.prompt_token_ids), []
        while len(out) < r.sampling.max_tokens and len(toks) < capacity:
            out.append(next_token(toks))
            toks.append(out[-1])
        truth[r.request_id] = out
    got = {r.request_id: [] for r in reqs}
    reasons = {}
    abort_at = {}
    for step, idx in aborts:
        abort_at.setdefault(step, []).append(f"r{idx}")
    for step in range(5000):
        for o in sched.abort(abort_at.get(step, [])):
            reasons[o.request_id] = o.finish_reason
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        assert not plan.is_empty
        for o in sched.update(plan, runner.execute(plan, cfg)):
            got[o.request_id] += o.new_token_ids
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not sched.has_unfinished() and set(reasons) == set(got)
    for rid, toks in got.items():
        if reasons[rid] == "abort":
            assert toks == truth[rid][: len(toks)]
        else:
            assert toks == truth[rid] and reasons[rid] == "length"
    assert sched.cache.num_reclaimable_blocks == num_blocks and sched.cache.num_free_slots == num_slots
    sched.cache.clear_prefixes()
    assert sched.cache.num_free_blocks == num_blocks
