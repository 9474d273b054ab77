"""The statistic behind an A/B verdict: baseline (A) and candidate (B) per-block medians from interleaved
subprocess rounds, an A/A noise floor, and an exact one-sided Mann-Whitney test.

``compare(a, b, direction, min_effect)`` says ``better``, ``worse`` or ``no difference``. "Better" needs
all three: the relative change of the medians beyond the noise floor (the spread of the baseline's own
blocks, measured in different subprocesses: what an A/A run would show), beyond ``min_effect``, and a
one-sided p-value below ``alpha``.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ABResult:
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


def mann_whitney_p(low: list[float], high: list[float]) -> float:
    """Exact one-sided p-value that ``low`` tends to be smaller than ``high`` (ties count one half):
    the fraction of relabellings of the pooled values whose U is at least the observed one."""
    def u_stat(xs, ys):
        return sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in xs for y in ys)

    pooled = list(low) + list(high)
    n = len(low)
    observed = u_stat(low, high)
    if len(pooled) > 20:
        raise ValueError("exact Mann-Whitney is for small samples (at most 20 values)")
    hits = total = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        picked = set(chosen)
        xs = [pooled[i] for i in chosen]
        ys = [pooled[i] for i in range(len(pooled)) if i not in picked]
        hits += u_stat(xs, ys) >= observed - 1e-12
        total += 1
    return hits / total


def noise_floor(values: list[float]) -> float:
    """Relative spread (max - min) / median of repeated measurements of one revision."""
    if len(values) < 2:
        return 0.0
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


def compare(a: list[float], b: list[float], direction: str = "lower", min_effect: float = 0.03,
            alpha: float = 0.05) -> ABResult:
    if len(a) < 2 or len(b) < 2:
        raise ValueError("an A/B comparison needs at least two measurements per side")
    ma, mb = statistics.median(a), statistics.median(b)
    if direction == "lower":
        change = (ma - mb) / ma if ma else 0.0
        p_better, p_worse = mann_whitney_p(b, a), mann_whitney_p(a, b)
    else:
        change = (mb - ma) / ma if ma else 0.0
        p_better, p_worse = mann_whitney_p(a, b), mann_whitney_p(b, a)
    floor = max(noise_floor(a), min_effect)
    if change > floor and p_better < alpha:
        verdict, p = "better", p_better
    elif -change > floor and p_worse < alpha:
        verdict, p = "worse", p_worse
    else:
        verdict, p = "no difference", min(p_better, p_worse)
    return ABResult(ma, mb, change, noise_floor(a), p, verdict, len(a), len(b))
