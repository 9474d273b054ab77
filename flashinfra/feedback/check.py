"""Running registered checks and reporting their figures (``flashinfra check [NAME...] [--json]``).

A check that raises, or returns something other than ``CheckResult``s, is a failed check whose message
carries the error; it never stops the other checks. Every run seeds the random generators with a fresh
seed (or ``--seed``) and reports it, so a failure found on fresh inputs can be replayed.
"""

from __future__ import annotations

import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from flashinfra.feedback import registry
from flashinfra.feedback.registry import CheckResult, Entry


@dataclass
class CheckRun:
    name: str
    tags: tuple[str, ...]
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.results) and all(r.passed for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "tags": list(self.tags), "passed": self.passed, "seconds": self.seconds,
                "error": self.error, "results": [r.to_dict() for r in self.results]}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def run_entry(entry: Entry, seed: int) -> CheckRun:
    run = CheckRun(name=entry.name, tags=entry.tags)
    seed_everything(seed)
    t0 = time.perf_counter()
    try:
        out = entry.fn()
    except Exception:
        run.error = traceback.format_exc(limit=-8)
        out = []
    run.seconds = time.perf_counter() - t0
    results = out if isinstance(out, (list, tuple)) else [out]
    for r in results:
        if isinstance(r, CheckResult):
            run.results.append(r)
        else:
            run.error = f"check returned {type(r).__name__}, expected CheckResult"
    if run.error is None and not run.results:
        run.error = "check returned no results"
    return run


def run_checks(patterns: list[str] | None = None, seed: int | None = None,
               providers: tuple[str, ...] = registry.PROVIDERS) -> tuple[list[CheckRun], list[tuple[str, str]], int]:
    """Load providers, run the checks matching ``patterns`` (all when empty). Returns the runs, the
    provider import errors and the seed used."""
    provider_errors = registry.load_providers(providers)
    entries = registry.select(registry.checks(), patterns)
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    return [run_entry(e, seed) for e in entries], provider_errors, seed


def format_text(runs: list[CheckRun], provider_errors: list[tuple[str, str]], seed: int) -> str:
    lines = []
    for module, tb in provider_errors:
        lines.append(f"ERROR importing provider {module}:\n{tb.rstrip()}")
    for run in runs:
        head = f"{'PASS' if run.passed else 'FAIL'} {run.name} ({run.seconds:.2f}s)"
        lines.append(head)
        for r in run.results:
            lines.append("    " + r.summary())
        if run.error:
            lines.append("    error: " + run.error.rstrip().replace("\n", "\n    "))
    failed = sum(not r.passed for r in runs)
    lines.append(f"{len(runs) - failed}/{len(runs)} checks passed, seed {seed}"
                 + (f", {len(provider_errors)} provider(s) failed to import" if provider_errors else ""))
    return "\n".join(lines)


def to_json(runs: list[CheckRun], provider_errors: list[tuple[str, str]], seed: int) -> dict[str, Any]:
    return {"seed": seed, "passed": all(r.passed for r in runs) and not provider_errors,
            "provider_errors": [{"module": m, "error": e} for m, e in provider_errors],
            "checks": [r.to_dict() for r in runs]}
