"""The statistics of every A/B verdict: bootstrap confidence intervals of a median, the Mann-Whitney U test,
noise floors, and the two verdicts built on them.

``compare_rounds(a, b, a2)`` (``flashinfra ab``, ``flashinfra.feedback.ab``): one median per subprocess run,
in rounds of A, B and A' (a second run of A). Per round the log-ratios d = log(B/A) and a = log(A'/A); the
noise floor is the largest |median| inside the 95% bootstrap interval of median(a), what an experiment with
no change shows on this machine; the threshold is the larger of it and ``min_effect``. "slower" when the 95%
bootstrap interval of median(d) lies wholly above +threshold and the Mann-Whitney test of B against A gives
p < alpha; "faster" symmetrically; else "no difference". Confidence is the bootstrap probability of the
verdict's region.

``compare_blocks(a_groups, b_groups)`` (the Infra Agent's gate): several block medians per subprocess, one
group per subprocess, so that a candidate is judged with four subprocesses instead of nine or more. The
noise floor is the larger of the two sides' spreads between their own subprocesses (``noise_floor``: what an
A/A or a B/B run would show). "better" needs the relative change of the medians beyond the noise floor and
``min_effect`` and a Mann-Whitney p-value below ``alpha``; "worse" symmetrically.

Pure Python (``random`` with a fixed seed, so a verdict is reproducible from its data); no numpy/scipy.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any


def bootstrap_medians(values: list[float], resamples: int = 5000, seed: int = 0) -> list[float]:
    """Sorted medians of ``resamples`` resamples (with replacement) of ``values``."""
    if not values:
        raise ValueError("bootstrap of no values")
    rng = random.Random(seed)
    n = len(values)
    return sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))


def quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def median_ci(values: list[float], level: float = 0.95, resamples: int = 5000, seed: int = 0
              ) -> tuple[float, float, list[float]]:
    """Percentile bootstrap interval of the median; also returns the bootstrap distribution."""
    boot = bootstrap_medians(values, resamples, seed)
    tail = (1 - level) / 2
    return quantile(boot, tail), quantile(boot, 1 - tail), boot


@lru_cache(maxsize=64)
def _u_counts(n1: int, n2: int) -> tuple[int, ...]:
    """Number of arrangements of n1 + n2 distinct values giving each U = 0..n1*n2 (exact null)."""
    # counts[i][j] = distribution of U for sizes (i, j), by the recurrence on the largest value.
    table = {(0, j): (1,) for j in range(n2 + 1)}
    for i in range(1, n1 + 1):
        table[(i, 0)] = (1,)
        for j in range(1, n2 + 1):
            a, b = table[(i - 1, j)], table[(i, j - 1)]
            size = i * j + 1
            dist = [0] * size
            for u, c in enumerate(a):  # largest value in the first sample: it beats all j others
                dist[u + j] += c
            for u, c in enumerate(b):
                dist[u] += c
            table[(i, j)] = tuple(dist)
    return table[(n1, n2)]


def mann_whitney(x: list[float], y: list[float]) -> dict[str, float]:
    """Two-sided Mann-Whitney U test that ``x`` and ``y`` come from one distribution. ``u`` counts pairs
    with x > y (ties one half); exact p-value without ties for small samples, normal approximation with
    tie correction otherwise. ``auc`` = u / (n1 n2): 0.5 means no tendency, 1 means every x > every y."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("Mann-Whitney needs two non-empty samples")
    u = sum((a > b) + 0.5 * (a == b) for a in x for b in y)
    pooled = x + y
    ties = len(set(pooled)) != len(pooled)
    if not ties and n1 * n2 <= 2500:
        counts = _u_counts(n1, n2)
        total = sum(counts)
        lo = min(u, n1 * n2 - u)
        p = min(1.0, 2 * sum(counts[: int(lo) + 1]) / total)
    else:
        ranks = _midranks(pooled)
        n = n1 + n2
        tie_term = sum(t**3 - t for t in _tie_sizes(pooled))
        sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))) if n > 1 else 0.0
        r1 = sum(ranks[:n1])
        u_from_ranks = r1 - n1 * (n1 + 1) / 2
        z = 0.0 if sigma == 0 else (abs(u_from_ranks - n1 * n2 / 2) - 0.5) / sigma
        p = min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))
    return {"u": u, "auc": u / (n1 * n2), "p_value": p}


def _midranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _tie_sizes(values: list[float]) -> list[int]:
    counts: dict[float, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return [c for c in counts.values() if c > 1]


def _beyond(lo: float, hi: float, threshold: float, p_value: float, alpha: float) -> int:
    """+1 when ``lo`` exceeds +threshold, -1 when ``hi`` is below -threshold (either only with
    ``p_value < alpha``), else 0."""
    if p_value >= alpha:
        return 0
    return 1 if lo > threshold else -1 if hi < -threshold else 0


def compare_rounds(a: list[float], b: list[float], a2: list[float], min_effect: float = 0.02,
                   alpha: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """The verdict ("faster", "slower" or "no difference" for B against A) from per-round medians of A, B
    and A' (same round = same index)."""
    if not (len(a) == len(b) == len(a2)) or len(a) < 3:
        raise ValueError("need at least 3 complete rounds of A, B and A'")
    d = [math.log(y / x) for x, y in zip(a, b)]
    aa = [math.log(y / x) for x, y in zip(a, a2)]
    lo, hi, boot = median_ci(d, seed=seed)
    aa_lo, aa_hi, _ = median_ci(aa, seed=seed + 1)
    noise = max(abs(aa_lo), abs(aa_hi))
    threshold = max(noise, math.log1p(min_effect))
    mw = mann_whitney(b, a)
    side = _beyond(lo, hi, threshold, mw["p_value"], alpha)
    result = {1: "slower", -1: "faster", 0: "no difference"}[side]
    region = {1: lambda v: v > threshold, -1: lambda v: v < -threshold,
              0: lambda v: -threshold <= v <= threshold}[side]
    confidence = sum(map(region, boot)) / len(boot)
    return {"verdict": result, "confidence": confidence, "ratio_b_over_a": math.exp(statistics.median(d)),
            "ratio_ci95": [math.exp(lo), math.exp(hi)], "noise_floor": math.expm1(noise),
            "aa_ratio": math.exp(statistics.median(aa)), "aa_ci95": [math.exp(aa_lo), math.exp(aa_hi)],
            "threshold": math.expm1(threshold), "mann_whitney_p": mw["p_value"], "mann_whitney_auc": mw["auc"],
            "median_a_s": statistics.median(a), "median_b_s": statistics.median(b), "rounds": len(a)}


@dataclass(frozen=True)
class ABResult:
    """The verdict of ``compare_blocks``."""

    baseline_median: float
    candidate_median: float
    change: float  # relative improvement in the better direction: +0.3 = 30% better
    noise_floor: float
    p_value: float
    verdict: str  # "better", "worse" or "no difference"
    n_baseline: int
    n_candidate: int

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.verdict}: baseline {self.baseline_median:.4g}, candidate {self.candidate_median:.4g} "
                f"({100 * self.change:+.1f}% better; noise floor {100 * self.noise_floor:.1f}%, "
                f"p={self.p_value:.3g}, n={self.n_baseline}+{self.n_candidate})")


def noise_floor(groups: list[list[float]]) -> float:
    """What an A/A experiment shows: the largest relative difference between the medians of the same
    revision measured in different subprocesses (one group per subprocess). With a single group, the
    interquartile range of its values relative to their median."""
    groups = [g for g in groups if g]
    pooled = [v for g in groups for v in g]
    if len(pooled) < 2:
        return 0.0
    med = statistics.median(pooled)
    if not med:
        return 0.0
    if len(groups) >= 2:
        medians = [statistics.median(g) for g in groups]
        return (max(medians) - min(medians)) / med
    q = statistics.quantiles(pooled, n=4)
    return (q[2] - q[0]) / med


def compare_blocks(a_groups: list[list[float]], b_groups: list[list[float]], direction: str = "lower",
                   min_effect: float = 0.03, alpha: float = 0.05) -> ABResult:
    """``a_groups`` and ``b_groups``: the baseline's and the candidate's values, one list per subprocess.
    A candidate whose own subprocesses disagree by 8% cannot show a 5% gain, however its pooled median
    falls."""
    a = [v for g in a_groups for v in g]
    b = [v for g in b_groups for v in g]
    if len(a) < 2 or len(b) < 2:
        raise ValueError("an A/B comparison needs at least two measurements per side")
    ma, mb = statistics.median(a), statistics.median(b)
    change = ((ma - mb) if direction == "lower" else (mb - ma)) / ma if ma else 0.0
    p = mann_whitney(b, a)["p_value"]
    spread = max(noise_floor(a_groups), noise_floor(b_groups))
    side = _beyond(change, change, max(spread, min_effect), p, alpha)
    verdict = {1: "better", -1: "worse", 0: "no difference"}[side]
    return ABResult(ma, mb, change, spread, p, verdict, len(a), len(b))
