"""The statistic behind an A/B verdict: baseline (A) and candidate (B) per-block medians from interleaved
subprocess rounds, a noise floor from each side's own spread, and the Mann-Whitney test of
``flashinfra.feedback.stats``.

``compare(a_groups, b_groups, direction, min_effect)`` says ``better``, ``worse`` or ``no difference``.
"Better" needs all three: the relative change of the medians beyond the noise floor (how far apart either
side's own subprocesses land: what an A/A or a B/B run would show), beyond ``min_effect``, and a
Mann-Whitney p-value below ``alpha`` (two-sided; the direction comes from the medians). This differs
from ``flashinfra.feedback.ab`` (whole subprocess rounds of A, B, A' per sample) in taking several block
medians per subprocess, so that a candidate is judged with four subprocesses instead of nine or more.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from flashinfra.feedback.stats import mann_whitney


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


def compare(a_groups: list[list[float]], b_groups: list[list[float]], direction: str = "lower",
            min_effect: float = 0.03, alpha: float = 0.05) -> ABResult:
    """``a_groups`` and ``b_groups``: the baseline's and the candidate's values, one list per subprocess. The
    noise floor is the larger of the two sides' spreads between subprocesses: a candidate whose own
    subprocesses disagree by 8% cannot show a 5% gain, however its pooled median falls."""
    a = [v for g in a_groups for v in g]
    b = [v for g in b_groups for v in g]
    if len(a) < 2 or len(b) < 2:
        raise ValueError("an A/B comparison needs at least two measurements per side")
    ma, mb = statistics.median(a), statistics.median(b)
    change = ((ma - mb) if direction == "lower" else (mb - ma)) / ma if ma else 0.0
    p = mann_whitney(b, a)["p_value"]
    spread = max(noise_floor(a_groups), noise_floor(b_groups))
    floor = max(spread, min_effect)
    if change > floor and p < alpha:
        verdict = "better"
    elif -change > floor and p < alpha:
        verdict = "worse"
    else:
        verdict = "no difference"
    return ABResult(ma, mb, change, spread, p, verdict, len(a), len(b))
