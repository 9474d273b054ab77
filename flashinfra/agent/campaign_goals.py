"""The goals file of an Infra Agent campaign (TOML): what to improve, how it is proven, what may change.

    [campaign]
    name = "transfer-gil"
    goal = "Prefill must not slow down while the transfer thread runs."   # told to the model
    base = "HEAD"                          # the revision every candidate starts from
    providers = ["myproj.checks"]          # modules that register checks and benchmarks

    [evaluation]
    checks = []                            # check patterns that must all pass ([] = every registered one)
    benchmarks = ["prefill_alone", "prefill_with_transfer"]
    rounds = 2                             # interleaved baseline/candidate rounds (ABAB...)
    repeats = 7                            # timed runs per benchmark per round
    min_effect = 0.03                      # smallest relative improvement that counts, beyond the noise

    [[target]]                             # must improve beyond the noise floor
    metric = "prefill_with_transfer"
    direction = "lower"

    [[criterion]]                          # must hold on the candidate (or metric/op/threshold, as in
    name = "transfer overhead"             # the goals files of ``flashinfra goals check``)
    expr = "prefill_with_transfer / prefill_alone <= 1.05"

    [guardrails]
    editable = ["myproj/**"]
    read_only = ["myproj/protocol.py"]     # tests, checks, benchmarks and this file are always read-only

    [budgets]
    iterations = 40                        # model turns
    wall_time_s = 1800
    tokens = 400000

    [sandbox]
    timeout_s = 120                        # wall clock per evaluation subprocess
    cpu_s = 240
    memory_mb = 8192
    allow_subprocess = false               # true: checks may start child processes (see SandboxLimits)

Metrics (names usable in ``metric`` and ``expr``): each benchmark's median seconds under its own name
(``B``, also ``B.median_s``, ``B.min_s``), and each check result's ``R.rel_norm``, ``R.max_abs`` and
``R.passed`` (1 or 0). This module parses and validates; expressions are evaluated by
``flashinfra.feedback.goals``, guardrails enforced by ``flashinfra.agent.paths``.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from flashinfra.feedback import goals as fb_goals

# Paths a candidate may never change, whatever the goals file says: the evidence and its judges.
ALWAYS_READ_ONLY = (
    ".git/**", ".gitignore", ".gitattributes", ".gitmodules",
    "tests/**", "**/tests/**", "test_*.py", "**/test_*.py", "conftest.py", "**/conftest.py",
    "checks.py", "**/checks.py", "**/checks/**", "benchmarks.py", "**/benchmarks.py", "bench/**",
    "flashinfra/feedback/**", "flashinfra/agent/**",
    "*.toml", "**/goals*.toml",
)


class GoalsError(ValueError):
    """The goals file is missing something or says something that cannot be honoured."""


@dataclass(frozen=True)
class Target:
    metric: str
    direction: str  # "lower" or "higher"


@dataclass(frozen=True)
class Criterion:
    name: str
    expr: str


@dataclass(frozen=True)
class Budgets:
    iterations: int = 40
    wall_time_s: float = 1800.0
    tokens: int = 400_000


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 120.0
    cpu_s: int = 240
    memory_mb: int = 8192
    # Checks that run part of their work in a child process need this; such children stay in the network
    # namespace and under the limits, but the file tripwire (an in-process audit hook) does not follow them.
    allow_subprocess: bool = False


@dataclass(frozen=True)
class Goals:
    path: Path
    name: str
    goal: str
    base: str
    providers: tuple[str, ...]
    checks: tuple[str, ...]
    benchmarks: tuple[str, ...]
    rounds: int
    repeats: int
    min_effect: float
    targets: tuple[Target, ...]
    criteria: tuple[Criterion, ...]
    editable: tuple[str, ...]
    read_only: tuple[str, ...]
    budgets: Budgets = field(default_factory=Budgets)
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)

    def read_only_patterns(self, repo: Path) -> tuple[str, ...]:
        """The goals file's read-only paths plus the ones that always are: tests, checks, benchmarks,
        the provider modules and the goals file itself (when it lives in the repository)."""
        extra = []
        for module in self.providers:
            stem = module.replace(".", "/")
            extra += [stem + ".py", stem + "/**"]
        try:
            extra.append(self.path.resolve().relative_to(repo.resolve()).as_posix())
        except ValueError:
            pass
        return tuple(dict.fromkeys(ALWAYS_READ_ONLY + self.read_only + tuple(extra)))

    def describe(self) -> str:
        """The goals as the model is told them."""
        lines = [f"Campaign {self.name}: {self.goal}".rstrip()]
        for t in self.targets:
            lines.append(f"- target: {t.metric} ({t.direction} is better), beyond the noise floor")
        for c in self.criteria:
            lines.append(f"- acceptance criterion {c.name!r}: {c.expr}")
        lines.append(f"- checks that must pass: {', '.join(self.checks) or 'all registered checks'}")
        lines.append(f"- benchmarks measured: {', '.join(self.benchmarks) or '(none)'}")
        lines.append(f"- editable paths: {', '.join(self.editable)}")
        lines.append(f"- read-only paths: {', '.join(self.read_only) or '(defaults only)'} "
                     "plus tests, checks, benchmarks and the goals file")
        b = self.budgets
        lines.append(f"- budgets: {b.iterations} turns, {b.wall_time_s:g} s, {b.tokens} tokens")
        return "\n".join(lines)


def _table(data: dict, key: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise GoalsError(f"[{key}] must be a table")
    return value


def _strings(table: dict, key: str, where: str) -> tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GoalsError(f"{where}.{key} must be a list of non-empty strings")
    return tuple(value)


def _positive(table: dict, key: str, default, kind, where: str):
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise GoalsError(f"{where}.{key} must be a positive number, got {value!r}")
    return kind(value)


def _flag(table: dict, key: str, where: str) -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise GoalsError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def load_goals(path: str | Path) -> Goals:
    """Parse and validate a goals file; every problem is a ``GoalsError`` naming the field."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoalsError(f"goals file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise GoalsError(f"goals file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - {"campaign", "evaluation", "target", "criterion", "guardrails", "budgets", "sandbox"}
    if unknown:
        raise GoalsError(f"unknown sections in {path}: {', '.join(sorted(unknown))}")
    campaign, evaluation = _table(data, "campaign"), _table(data, "evaluation")
    guardrails, budgets, sandbox = _table(data, "guardrails"), _table(data, "budgets"), _table(data, "sandbox")
    name = campaign.get("name")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
        raise GoalsError("campaign.name must be a non-empty name of letters, digits, '-', '_' or '.'")
    targets = []
    for i, t in enumerate(data.get("target", [])):
        if not isinstance(t, dict) or not isinstance(t.get("metric"), str):
            raise GoalsError(f"target[{i}].metric must be a string")
        direction = t.get("direction", "lower")
        if direction not in ("lower", "higher"):
            raise GoalsError(f"target[{i}].direction must be 'lower' or 'higher', got {direction!r}")
        targets.append(Target(t["metric"], direction))
    criteria = []
    for i, c in enumerate(data.get("criterion", [])):
        if not isinstance(c, dict):
            raise GoalsError(f"criterion[{i}] must be a table")
        try:
            criteria.append(Criterion(*fb_goals.criterion_expr(c, i)))
        except fb_goals.GoalsError as exc:
            raise GoalsError(f"criterion[{i}]: {exc}") from None
    editable = _strings(guardrails, "editable", "guardrails")
    if not editable:
        raise GoalsError("guardrails.editable must name at least one path: the agent needs somewhere to work")
    if not targets and not criteria:
        raise GoalsError("a campaign needs at least one [[target]] or [[criterion]]")
    min_effect = evaluation.get("min_effect", 0.03)
    if not isinstance(min_effect, (int, float)) or not 0 <= min_effect < 1:
        raise GoalsError("evaluation.min_effect must be in [0, 1)")
    return Goals(
        path=path.resolve(),
        name=name,
        goal=str(campaign.get("goal", "")),
        base=str(campaign.get("base", "HEAD")),
        providers=_strings(campaign, "providers", "campaign"),
        checks=_strings(evaluation, "checks", "evaluation"),
        benchmarks=_strings(evaluation, "benchmarks", "evaluation"),
        rounds=_positive(evaluation, "rounds", 2, int, "evaluation"),
        repeats=_positive(evaluation, "repeats", 7, int, "evaluation"),
        min_effect=float(min_effect),
        targets=tuple(targets),
        criteria=tuple(criteria),
        editable=editable,
        read_only=_strings(guardrails, "read_only", "guardrails"),
        budgets=Budgets(
            iterations=_positive(budgets, "iterations", 40, int, "budgets"),
            wall_time_s=_positive(budgets, "wall_time_s", 1800.0, float, "budgets"),
            tokens=_positive(budgets, "tokens", 400_000, int, "budgets"),
        ),
        sandbox=SandboxLimits(
            timeout_s=_positive(sandbox, "timeout_s", 120.0, float, "sandbox"),
            cpu_s=_positive(sandbox, "cpu_s", 240, int, "sandbox"),
            memory_mb=_positive(sandbox, "memory_mb", 8192, int, "sandbox"),
            allow_subprocess=_flag(sandbox, "allow_subprocess", "sandbox"),
        ),
    )
