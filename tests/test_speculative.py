"""Speculative decoding with the MTP layer through ``LLM``: greedy output equals decoding without drafts,
over mixed batches, under preemption, with prefix hits and chunked prefill; seeded sampling reproduces."""

from __future__ import annotations

import random

import pytest

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint
from tests.spec_oracle import plant_drafts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), seed=0, num_nextn_predict_layers=1)


def _prompts(seed, n, max_len=24):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 512) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 12), temperature=0.0, ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(ckpt):
    prompts, params = _prompts(0, 6)
    base = flashinfra.LLM(ckpt, num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    return prompts, params, [o.token_ids for o in base.generate(prompts, params)]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_drafts_equals_without(ckpt, reference, k):
    prompts, params, want = reference
    llm = flashinfra.LLM(ckpt, num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                         speculative_tokens=k)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = llm.engine.runner.speculator
    assert spec.num_drafted > 0


def test_greedy_with_drafts_under_preemption_and_chunked_prefill(ckpt, reference):
    prompts, params, want = reference
    small = flashinfra.LLM(ckpt, num_blocks=30, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                           max_prefill_chunk=5, speculative_tokens=2)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.engine.stats().num_preemptions_total > 0


def test_greedy_with_drafts_and_prefix_hits(ckpt):
    rng = random.Random(5)
    system = [rng.randrange(10, 512) for _ in range(14)]
    prompts = [system + [rng.randrange(10, 512) for _ in range(rng.randrange(1, 6))] for _ in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cold = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4, prefix_cache_slots=0)
    warm = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4, prefix_checkpoint_interval=8,
                          speculative_tokens=3)
    first = [o.token_ids for o in warm.generate(prompts, params)]
    assert first == [o.token_ids for o in cold.generate(prompts, params)]
    follow = [prompts[1], prompts[0] + first[0] + [33, 44]]
    assert [o.token_ids for o in warm.generate(follow, params)] == [o.token_ids for o in cold.generate(follow, params)]
    assert warm.engine.stats().num_prefix_hit_tokens_total > 0


def test_seeded_sampling_with_drafts_is_reproducible(ckpt):
    prompts, _ = _prompts(3, 3, max_len=10)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4, speculative_tokens=2)
        runs.append([o.token_ids for o in llm.generate(prompts, seeded)])
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])


def test_sampled_rows_with_drafts_share_a_batch(ckpt):
    """Greedy, seeded and unseeded sampled rows (and one with a penalty, accepted on its own) in one batch: the
    greedy row's tokens are those decoding without drafts gives, and the seeded row's do not depend on its
    neighbours (its random numbers are its generator's alone, whatever the other rows draw)."""
    prompts, _ = _prompts(5, 4, max_len=10)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, ignore_eos=True)
    penalised = SamplingParams(max_tokens=8, temperature=0.7, presence_penalty=0.5, ignore_eos=True)
    llm = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4, speculative_tokens=2)
    together = [o.token_ids for o in llm.generate(prompts, [greedy, seeded, unseeded, penalised])]
    apart = [o.token_ids for o in llm.generate([prompts[2], prompts[1]], [unseeded, seeded])]
    base = flashinfra.LLM(ckpt, num_blocks=128, block_size=4, max_num_seqs=4)
    assert together[0] == base.generate([prompts[0]], greedy)[0].token_ids
    assert together[1] == apart[1]
    assert all(len(t) == 8 and all(0 <= x < 4096 for x in t) for t in together)


def test_no_mtp_layer_is_refused(tmp_path):
    plain = write_tiny_checkpoint(tmp_path / "plain", seed=0)
    with pytest.raises(ValueError, match="MTP layer"):
        flashinfra.LLM(plain, num_blocks=16, speculative_tokens=1)


def test_oracle_drafts_fold_accepted_prefixes(ckpt, reference):
    """Drafts from the known greedy continuation, one in five corrupted: long accepted prefixes and partial
    rejections both go through the fold, and the output is still the reference."""
    prompts, params, want = reference
    by_prompt = {tuple(p): w for p, w in zip(prompts, want)}
    llm = flashinfra.LLM(ckpt, num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                         speculative_tokens=4)
    spec = llm.engine.runner.speculator
    plant_drafts(llm, by_prompt, 512)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert spec.num_accepted_at[2] > 0 and spec.num_drafted > sum(spec.num_accepted_at)


def _logprob_tuples(outputs):
    return [[(lp.token_id, lp.logprob, tuple(lp.top)) for lp in o.logprobs] for o in outputs]


@pytest.mark.parametrize("extra", [dict(logprobs=3), dict(repetition_penalty=1.3, logprobs=0),
                                   dict(frequency_penalty=0.7, presence_penalty=0.4)])
def test_greedy_with_drafts_logprobs_and_penalties_equal_without(ckpt, extra):
    """Logprobs come from the verify step's logits at each emitted position; penalties count the drafts before
    each position: tokens and logprobs as without drafts."""
    prompts, params = _prompts(1, 5)
    params = [SamplingParams(max_tokens=p.max_tokens + 4, temperature=0.0, ignore_eos=True, **extra) for p in params]
    kw = dict(num_blocks=256, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    want = flashinfra.LLM(ckpt, **kw).generate(prompts, params)
    llm = flashinfra.LLM(ckpt, speculative_tokens=3, **kw)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.runner.speculator.num_drafted > 0
    if "logprobs" in extra:
        # the verify step computes a position's logits in a multi-token pass, decode in a one-token pass: float32
        # rounding apart (a few units of 1e-6 relative on logprobs of a few nats)
        tol = 1e-4
        g, w = _logprob_tuples(got), _logprob_tuples(want)
        assert [[t for t, _, _ in r] for r in g] == [o.token_ids for o in want]
        for rg, rw in zip(g, w):
            for (tg, lg, topg), (tw, lw, topw) in zip(rg, rw, strict=True):
                assert tg == tw and lg == pytest.approx(lw, abs=tol)
                assert [i for i, _ in topg] == [i for i, _ in topw]
                assert [v for _, v in topg] == pytest.approx([v for _, v in topw], abs=tol)


def test_built_in_mtp_layer_drafts_real_text():
    """The built-in model's trained MTP layer: greedy output on held-out text equals decoding without drafts, and
    a useful share of its first drafts is accepted (43% teacher-forced at training; a random layer accepts ~0)."""
    from pathlib import Path

    text = (Path(__file__).parent / "eval" / "data" / "heldout-slice.txt").read_text()
    base = flashinfra.LLM()
    ids = base.tokenizer.encode(text).ids
    prompts = [ids[i : i + 48] for i in (0, 60, 120, 180)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in base.generate(prompts, params)]
    llm = flashinfra.LLM(speculative_tokens=1)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = llm.engine.runner.speculator
    assert spec.num_drafted > 40 and sum(spec.num_accepted_at) / spec.num_drafted > 0.15


def test_drafting_pauses_above_max_batch_and_resumes_with_the_same_drafts(monkeypatch):
    """``speculative_max_batch=2``: while more than two requests decode no step drafts (plain decode steps, the MTP
    layer's catch-up deferred); as requests finish, one catch-up over the deferred positions resumes drafting, and
    the hidden it drafts from (the catch-up's last entry, attending over every deferred one) is the one a run that
    never paused computes, at the same request and position, to float32 rounding; so are the drafts. Greedy output
    equals decoding without drafts. The built-in model: its trained MTP layer gives drafts with margins."""
    from pathlib import Path

    import torch

    from flashinfra.engine.speculative import Speculator

    text = (Path(__file__).parent / "eval" / "data" / "heldout-slice.txt").read_text()
    base = flashinfra.LLM()
    ids = base.tokenizer.encode(text).ids
    prompts = [ids[i : i + 40] for i in (0, 70, 140, 210)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 9, 20, 28)]
    want = [o.token_ids for o in base.generate(prompts, params)]
    drafted, paused, chained = {}, [], []
    draft, chain = Speculator.draft, Speculator._chain

    def chain_seen(spec, h, pos, slots, *args):
        chained.append((h.clone(), list(zip(pos, slots))))  # rows by (position, state slot): positions may repeat
        return chain(spec, h, pos, slots, *args)

    def recorded(spec, sched, feeds, cu, hidden, committed, nexts):
        chained.clear()
        draft(spec, sched, feeds, cu, hidden, committed, nexts)
        if spec.max_batch:
            paused.append(bool(spec.deferred))
        for b, sr in enumerate(sched):
            pos = sr.context_len + committed[b]
            if sr.request_id in spec.drafts:
                h, where = chained[0]
                drafted.setdefault(spec.max_batch, {})[(tuple(sr.prompt_token_ids), pos)] = (
                    spec.drafts[sr.request_id], h[where.index((pos, sr.state_slot))])

    monkeypatch.setattr(Speculator, "draft", recorded)
    monkeypatch.setattr(Speculator, "_chain", chain_seen)
    for max_batch in (0, 2):
        llm = flashinfra.LLM(speculative_tokens=2, speculative_max_batch=max_batch)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    always, sometimes = drafted[0], drafted[2]
    assert True in paused and not paused[-1], "steps deferred the catch-up, and drafting resumed"
    # the positions both runs drafted at (accepted drafts make each run skip positions of its own)
    resumed = [k for k in sometimes if k in always]
    assert len(resumed) >= 10
    for k in resumed:
        torch.testing.assert_close(sometimes[k][1], always[k][1], rtol=1e-4, atol=1e-4)
    same = sum(always[k][0] == sometimes[k][0] for k in resumed)
    assert same >= 0.9 * len(resumed), (same, len(resumed))
