"""Statistics for A/B verdicts: bootstrap confidence intervals of a median, and the Mann-Whitney U test.

Pure Python (``random`` with a fixed seed, so a verdict is reproducible from its data); no numpy/scipy.
"""

from __future__ import annotations

import math
import random
import statistics
from functools import lru_cache


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
