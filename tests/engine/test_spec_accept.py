"""Draft acceptance: greedy exact match; rejection sampling keeps the target distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from flashinfra.engine.spec_accept import greedy_accept, rejection_accept_rows


def test_greedy_accept():
    assert greedy_accept([3, 4, 5, 6], [3, 4, 5]) == [3, 4, 5, 6]
    assert greedy_accept([3, 9, 5, 6], [3, 4, 5]) == [3, 9]
    assert greedy_accept([1, 2], [7]) == [1]
    assert greedy_accept([8], []) == [8]


def _chi2_p(samples: list[int], probs: torch.Tensor) -> float:
    V = probs.shape[0]
    obs = torch.bincount(torch.tensor(samples), minlength=V).double()
    keep = probs > 0
    exp = probs.double() / probs.double()[keep].sum() * obs.sum()
    assert obs[~keep].sum() == 0  # nothing outside the support
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


def test_rejection_sampling_preserves_the_target_distribution():
    V, N = 6, 12000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    p[1, 5] = 0.0  # a token outside the target's support
    p[1] /= p[1].sum()
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    gen = torch.Generator().manual_seed(1)
    first, second, lengths = [], [], []
    for one_hot in (False, True):
        for _ in range(N // 2):
            if one_hot:
                d = [2, 5]
                out = rejection_accept_rows(p, [d], [gen])[0]
            else:
                d = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
                out = rejection_accept_rows(p, [d], [gen], draft_probs=torch.cat([q, torch.zeros_like(q[:1])]))[0]
            first.append(out[0])
            lengths.append(len(out))
            if out[0] == d[0] and len(out) > 1:
                second.append(out[1])
    # the first token ~ p0; given the first draft kept, the next ~ p1 (what the target would sample there)
    assert _chi2_p(first, p[0]) > 1e-3
    assert _chi2_p(second, p[1]) > 1e-3
    assert max(lengths) == 3 and min(lengths) == 1


def test_seeded_generator_reproduces():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 9, generator=g), -1)
    a = [rejection_accept_rows(p, [[1, 2, 3]], [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_rows_at_once_preserve_the_target_distribution():
    """Many rows in one call, rows with a generator of their own beside rows sharing one: each row's first token
    ~ p0, and after a kept first draft the next ~ p1; rows of different draft counts in one batch."""
    V, R = 6, 3000
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    p[1, 5] = 0.0
    p[1] /= p[1].sum()
    drafts = [[2, 5] if r % 3 else [2] for r in range(R)]
    probs = torch.cat([p if len(d) == 2 else torch.stack([p[0], p[1]]) for d in drafts])
    gens = [torch.Generator().manual_seed(r) if r % 5 == 0 else None for r in range(R)]
    out = rejection_accept_rows(probs, drafts, gens, torch.Generator().manual_seed(4))
    first = [o[0] for o in out]
    second = [o[1] for o, d in zip(out, drafts) if o[0] == d[0] and len(o) > 1]
    assert _chi2_p(first, p[0]) > 1e-3
    assert _chi2_p(second, p[1]) > 1e-3
    assert all(1 <= len(o) <= len(d) + 1 for o, d in zip(out, drafts))
    assert all(o[:-1] == d[:len(o) - 1] for o, d in zip(out, drafts))  # kept drafts, then one drawn token


def test_a_seeded_row_does_not_depend_on_its_neighbours():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, 9, generator=g), -1)
    alone = rejection_accept_rows(p[:4], [[1, 2, 3]], [torch.Generator().manual_seed(7)])[0]
    for shared_seed in (1, 2):
        got = rejection_accept_rows(p, [[1, 2, 3], [4, 5, 6]], [torch.Generator().manual_seed(7), None],
                                    torch.Generator().manual_seed(shared_seed))
        assert got[0] == alone


def test_rows_need_a_generator():
    p = torch.softmax(torch.randn(2, 5), -1)
    with pytest.raises(ValueError, match="shared"):
        rejection_accept_rows(p, [[1]], [None])
    with pytest.raises(ValueError, match="positions"):
        rejection_accept_rows(p, [[1, 2]], [None], torch.Generator())
