"""Sampler: every parameter against a direct float64 computation, seeded reproducibility, error isolation."""

from __future__ import annotations

import math

import pytest
import torch

from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.engine.sampler import SamplingRow, apply_penalties, sample, truncated_probs


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def row(params: SamplingParams, prompt=(), output=(), seed=None) -> SamplingRow:
    g = None if params.greedy and seed is None else gen(0 if seed is None else seed)
    return SamplingRow(params, list(prompt), list(output), g)


def ref_penalties(x: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    x = list(x)
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_truncated(x: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    V = len(x)
    order = sorted(range(V), key=lambda i: -x[i])
    kept = order[: top_k] if top_k > 0 else order
    m = max(x[i] / temperature for i in kept)
    w = {i: math.exp(x[i] / temperature - m) for i in kept}
    z = sum(w.values())
    pr = {i: w[i] / z for i in kept}
    mass, chosen = 0.0, []
    for i in kept:
        if mass >= top_p:
            break
        chosen.append(i)
        mass += pr[i]
    pmax = pr[kept[0]]
    chosen = [i for i in chosen if pr[i] >= min_p * pmax]
    z = sum(pr[i] for i in chosen)
    out = [0.0] * V
    for i in chosen:
        out[i] = pr[i] / z
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_direct_computation(seed):
    torch.manual_seed(seed)
    V = 97
    logits = torch.randn(3, V, dtype=torch.float64) * 3
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.3),
        SamplingParams(repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=1.1),
    ]
    rows = []
    for p in params:
        prompt = torch.randint(0, V, (13,)).tolist()
        output = torch.randint(0, V, (29,)).tolist()
        rows.append(row(p, prompt, output))
    got = apply_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        want = ref_penalties(logits[i].tolist(), r.params, r.prompt_token_ids, r.output_token_ids)
        torch.testing.assert_close(got[i], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.2), (0.9, 17, 0.8, 0.05),
     (2.0, 1, 1.0, 0.0), (1.0, 200, 0.3, 0.0)],
)
def test_truncation_matches_direct_computation(temperature, top_k, top_p, min_p):
    torch.manual_seed(int(temperature * 100) + top_k)
    V = 101
    x = torch.randn(4, V, dtype=torch.float64) * 2
    n = x.shape[0]
    got = truncated_probs(
        x,
        torch.full((n,), temperature, dtype=torch.float64),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p, dtype=torch.float64),
        torch.full((n,), min_p, dtype=torch.float64),
    )
    for i in range(n):
        want = torch.tensor(ref_truncated(x[i].tolist(), temperature, top_k, top_p, min_p), dtype=torch.float64)
        torch.testing.assert_close(got[i], want, rtol=1e-9, atol=1e-12)


def test_sampling_frequencies_follow_the_truncated_distribution():
    torch.manual_seed(3)
    V = 12
    logits = torch.randn(1, V) * 1.5
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05)
    want = torch.tensor(ref_truncated(logits[0].double().tolist(), 0.8, 8, 0.9, 0.05))
    g = gen(11)
    N = 20000
    counts = torch.zeros(V)
    for _ in range(N // 500):  # 500 draws per call, each from its own row generator state
        rows = [SamplingRow(p, [], [], g) for _ in range(500)]
        tokens, _, errors = sample(logits.expand(500, V).contiguous(), rows)
        assert errors == [None] * 500
        counts += torch.bincount(torch.tensor(tokens), minlength=V)
    freq = counts / N
    assert counts[want == 0].sum() == 0, "a truncated token was sampled"
    assert torch.allclose(freq, want.float(), atol=0.015), (freq, want)


def test_greedy_is_argmax_of_penalized_logits():
    torch.manual_seed(4)
    V = 50
    logits = torch.randn(2, V)
    top = int(logits[0].argmax())
    rows = [row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0), output=[top] * 3)]
    logits[1] = logits[0]
    tokens, _, errors = sample(logits, rows)
    assert errors == [None, None]
    assert tokens[0] == top
    pen = logits[0].clone()
    pen[top] -= 2.0 * 3 + 2.0
    assert tokens[1] == int(pen.argmax()) and tokens[1] != top


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(5)
    V = 300
    steps = [torch.randn(6, V) for _ in range(8)]
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone_g = gen(1234)
    alone = [sample(s[2:3], [SamplingRow(p, [], [], alone_g)])[0][0] for s in steps]
    batch_g = [gen(1234 if i == 2 else 99 + i) for i in range(6)]
    in_batch = []
    for s in steps:
        rows = [SamplingRow(p if i == 2 else SamplingParams(temperature=0.5 + i / 10, top_k=i), [], [], batch_g[i])
                for i in range(6)]
        in_batch.append(sample(s, rows)[0][2])
    assert alone == in_batch
    other_g = gen(4321)
    other = [sample(s[2:3], [SamplingRow(p, [], [], other_g)])[0][0] for s in steps]
    assert other != alone


def test_logprobs_are_model_logprobs_with_top_list():
    torch.manual_seed(6)
    V = 40
    logits = torch.randn(3, V)
    rows = [row(SamplingParams(temperature=0.0, logprobs=5)), row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=1.5), prompt=[1, 2])]
    tokens, lps, errors = sample(logits, rows)
    assert errors == [None] * 3 and lps[1] is None
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert lps[0].token_id == tokens[0] and lps[0].logprob == pytest.approx(float(ref[0, tokens[0]]), abs=1e-5)
    want_top = ref[0].topk(5)
    assert [t for t, _ in lps[0].top] == want_top.indices.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(want_top.values.tolist(), abs=1e-5)
    assert lps[2].top == [] and lps[2].logprob == pytest.approx(float(ref[2, tokens[2]]), abs=1e-5)


def test_a_failing_row_fails_alone():
    torch.manual_seed(7)
    V = 30
    logits = torch.randn(3, V)
    logits[1, 4] = float("nan")
    rows = [row(SamplingParams(temperature=0.0)), row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt=[V + 5])]
    tokens, _, errors = sample(logits, rows)
    assert tokens[0] == int(logits[0].argmax()) and errors[0] is None
    assert tokens[1] is None and "NaN" in errors[1]
    assert tokens[2] is None and errors[2].startswith("sampling failed")


def test_seeded_row_is_unaffected_by_a_failing_neighbour():
    torch.manual_seed(8)
    V = 64
    logits = torch.randn(2, V)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[:1], [SamplingRow(p, [], [], gen(7))])[0][0]
    logits[1, 0] = float("nan")
    got = sample(logits, [SamplingRow(p, [], [], gen(7)), SamplingRow(SamplingParams(), [], [], gen(1))])[0]
    assert got[0] == alone and got[1] is None


def test_validate_rejects_bad_values():
    SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, seed=3, logprobs=2).validate(100)
    bad = [dict(max_tokens=0), dict(max_tokens=101), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
           dict(top_k=-1), dict(min_p=1.5), dict(presence_penalty=3.0), dict(frequency_penalty=-2.5),
           dict(repetition_penalty=0.0), dict(seed=-1), dict(stop_token_ids=(-3,)), dict(logprobs=21),
           dict(temperature=float("nan"))]
    for kw in bad:
        field = next(iter(kw))
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw).validate(100)


def test_unseeded_rows_share_one_draw_and_seeded_rows_keep_their_own_stream(monkeypatch):
    """Sampled rows without a generator of their own draw their noise together from the shared generator (one
    launch for all of them, whatever their number); a seeded row still consumes only its own, so its tokens are
    those it draws alone; the shared rows' tokens follow the truncated distribution."""
    torch.manual_seed(6)
    V = 12
    logits = torch.randn(1, V) * 1.5
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05)
    want = torch.tensor(ref_truncated(logits[0].double().tolist(), 0.8, 8, 0.9, 0.05))
    draws = []
    real = torch.Tensor.exponential_

    def counted(self, *args, **kwargs):
        draws.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "exponential_", counted)
    shared, seeded = gen(21), SamplingParams(temperature=1.0, seed=77)
    N, counts = 20000, torch.zeros(V)
    for _ in range(N // 500):
        rows = [SamplingRow(p, [], [], None) for _ in range(500)]
        tokens, _, errors = sample(logits.expand(500, V).contiguous(), rows, shared=shared)
        assert errors == [None] * 500
        counts += torch.bincount(torch.tensor(tokens), minlength=V)
    assert len(draws) == N // 500  # one draw a batch
    assert counts[want == 0].sum() == 0 and torch.allclose(counts / N, want.float(), atol=0.015)

    steps = [torch.randn(5, V) for _ in range(6)]
    own = gen(77)
    alone = [sample(s[1:2], [SamplingRow(seeded, [], [], own)])[0][0] for s in steps]
    own, draws[:] = gen(77), []
    mixed = [sample(s, [SamplingRow(seeded if i == 1 else p, [], [], own if i == 1 else None) for i in range(5)],
                    shared=shared)[0][1] for s in steps]
    assert mixed == alone and len(draws) == 2 * len(steps)  # the shared draw and the seeded row's own
    _, _, errors = sample(steps[0][:2], [SamplingRow(p, [], [], None), row(SamplingParams(temperature=0.0))])
    assert errors[0] is not None and "generator" in errors[0] and errors[1] is None  # no shared generator given


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_runner_gives_a_row_its_own_generator_when_seeded_or_deterministic(deterministic):
    import random
    import types

    from flashinfra.engine.runner import ModelRunner

    runner = object.__new__(ModelRunner)  # only the generator bookkeeping
    runner.deterministic, runner.generators, runner.device = deterministic, {}, torch.device("cpu")
    runner._seeds = random.Random(0)

    def sr(rid, **params):
        return types.SimpleNamespace(request_id=rid, sampling=SamplingParams(**params))

    assert runner._row_generator(sr("greedy", temperature=0.0)) is None
    seeded = runner._row_generator(sr("seeded", temperature=1.0, seed=5))
    assert seeded is runner._row_generator(sr("seeded", temperature=1.0, seed=5))  # kept across steps
    assert torch.equal(seeded.get_state(), gen(5).get_state())
    unseeded = runner._row_generator(sr("unseeded", temperature=1.0))
    assert (unseeded is not None) == deterministic  # else it draws from the runner's shared generator
