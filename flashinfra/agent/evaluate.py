"""Running feedback tasks on a worktree in the sandbox, and the gate every candidate must pass.

``Runner.run(worktree, tasks, ...)`` runs ``flashinfra.agent.worker`` on a worktree in a limited,
network-less subprocess and returns its JSON with the sandbox ``Outcome``. ``Gate.evaluate`` decides a
candidate, in this order, stopping at the first failure:

1. guardrails: the changed paths (committed, staged, unstaged, untracked) must all be editable, and none
   a symlink; nothing of the candidate runs otherwise;
2. correctness: every check the goals select passes in the candidate (fresh seed), and no benchmark is
   flagged (cached output, wrong output);
3. measurement: interleaved rounds (B A, A B, ...) of baseline and candidate subprocesses, each timing the
   goals' benchmarks in blocks; per-block medians feed ``flashinfra.feedback.stats.compare_blocks``;
4. acceptance criteria hold on the candidate's metrics;
5. every target improves beyond the noise floor.

A run stopped by the sandbox (violation, timeout, crash) fails the candidate and is recorded with what
was attempted.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import flashinfra
from flashinfra.agent import worktree
from flashinfra.agent.campaign_goals import Goals
from flashinfra.agent.paths import Guardrails
from flashinfra.agent.sandbox import Outcome, candidate_env, run_limited
from flashinfra.feedback import goals as fb_goals
from flashinfra.feedback import stats

BLOCKS = 3  # benchmark blocks per subprocess; each block's median is one sample of the A/B statistic


@dataclass
class TaskRun:
    result: dict | None
    outcome: Outcome
    workdir: Path

    @property
    def failure(self) -> str:
        if not self.outcome.ok:
            return self.outcome.failure()
        if self.result is None:
            return "the worker wrote no result"
        if not self.result.get("ok", False):
            return "the worker failed: " + str(self.result.get("error", ""))[-800:]
        return ""


class Runner:
    """Spawns worker subprocesses for one campaign; numbers their directories under ``workdir``."""

    def __init__(self, goals: Goals, workdir: Path, secrets: tuple[str, ...] = ()):
        self.goals = goals
        self.workdir = workdir
        self.secrets = secrets
        self.trusted_root = Path(flashinfra.__file__).resolve().parent.parent
        self._counter = itertools.count(1 + len(list(workdir.glob("run-*"))) if workdir.exists() else 1)

    def run(self, tree: Path, tasks: list[str], timeout_s: float | None = None, **spec) -> TaskRun:
        workdir = self.workdir / f"run-{next(self._counter):04d}"
        workdir.mkdir(parents=True)
        spec = {"tasks": tasks, "repo": str(tree), "workdir": str(workdir), "out": str(workdir / "result.json"),
                "violations": str(workdir / "violations.jsonl"), "providers": list(self.goals.providers),
                "allow_subprocess": self.goals.sandbox.allow_subprocess, **spec}
        (workdir / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        env = candidate_env([tree, self.trusted_root], workdir, self.secrets)
        outcome = run_limited([sys.executable, "-m", "flashinfra.agent.worker", str(workdir / "spec.json")],
                              cwd=tree, limits=self.goals.sandbox, env=env,
                              violations_file=workdir / "violations.jsonl", timeout_s=timeout_s,
                              writable=[tree, workdir])
        result = None
        if (workdir / "result.json").exists():
            result = json.loads((workdir / "result.json").read_text(encoding="utf-8"))
        return TaskRun(result, outcome, workdir)


def check_metrics(checks_json: dict) -> dict[str, float]:
    metrics = {}
    for run in checks_json.get("checks", []):
        for r in run["results"]:
            metrics[f"{r['name']}.rel_norm"] = float(r["rel_norm"])
            metrics[f"{r['name']}.max_abs"] = float(r["max_abs"])
            metrics[f"{r['name']}.passed"] = 1.0 if r["passed"] else 0.0
        metrics[f"{run['name']}.passed"] = 1.0 if run["passed"] else 0.0
    return metrics


def _flat(groups: list[list[float]]) -> list[float]:
    return [v for g in groups for v in g]


def bench_metrics(blocks: dict[str, list[list[float]]]) -> dict[str, float]:
    """Benchmark figures from block medians grouped by subprocess."""
    metrics = {}
    for name, groups in blocks.items():
        values = _flat(groups)
        metrics[name] = metrics[f"{name}.median_s"] = statistics.median(values)
        metrics[f"{name}.min_s"] = min(values)
    return metrics


def failed_checks(checks_json: dict) -> list[str]:
    lines = [f"provider {e['module']} failed to import" for e in checks_json.get("provider_errors", [])]
    for run in checks_json.get("checks", []):
        if not run["passed"]:
            bad = [r for r in run["results"] if not r["passed"]]
            detail = "; ".join(f"{r['name']} rel_norm={r['rel_norm']} bad={r['num_bad']}/{r['numel']} "
                               f"extent={r['bad_extent']} {r['message']}".rstrip() for r in bad)
            lines.append(f"check {run['name']} failed: {detail or run['error']}")
    return lines


class Gate:
    def __init__(self, goals: Goals, runner: Runner, base_tree: Path, base_sha: str):
        self.goals, self.runner = goals, runner
        self.base_tree, self.base_sha = base_tree, base_sha
        self.guardrails = Guardrails(goals.editable, goals.read_only_patterns(base_tree))

    def guardrail_violations(self, tree: Path) -> tuple[list[str], list[str]]:
        changed = worktree.changed_files(tree, self.base_sha)
        problems = self.guardrails.violations(changed)
        problems += [f"{p} is a symlink" for p in worktree.symlinks_changed(tree, self.base_sha)]
        return changed, problems

    def evaluate(self, tree: Path, record) -> dict:
        """Decide the candidate in ``tree``; ``record(kind, **fields)`` journals each measurement."""
        g = self.goals
        verdict = {"passed": False, "reasons": [], "changed": [], "criteria": [], "targets": [], "runs": []}
        changed, problems = self.guardrail_violations(tree)
        verdict["changed"] = changed
        if not changed:
            verdict["reasons"].append("no change against the base revision")
        verdict["reasons"] += problems
        if verdict["reasons"]:
            return verdict
        seed = random.SystemRandom().randrange(2**31)
        target_checks = [t for t in g.targets if t.metric not in g.benchmarks]
        blocks = {"A": {}, "B": {}}
        checks = {}
        for r in range(max(g.rounds, 1) if g.benchmarks else 1):
            for side in ("B", "A") if r % 2 == 0 else ("A", "B"):
                tasks = (["checks"] if r == 0 and (side == "B" or target_checks) else []) + \
                        (["bench"] if g.benchmarks else [])
                tree_s = tree if side == "B" else self.base_tree
                run = self.runner.run(tree_s, tasks, patterns=list(g.checks), seed=seed,
                                      benchmarks=list(g.benchmarks), repeats=g.repeats, blocks=BLOCKS)
                summary = {"side": side, "round": r, "tasks": tasks, "dir": str(run.workdir),
                           **run.outcome.to_dict()}
                verdict["runs"].append(summary)
                record("measurement", **summary, result=run.result)
                if run.failure:
                    who = "candidate" if side == "B" else "baseline"
                    verdict["reasons"].append(f"{who} run {run.failure}")
                    verdict["sandbox"] = run.outcome.violations
                    return verdict
                if "checks" in run.result:
                    checks[side] = run.result["checks"]
                    if side == "B":
                        verdict["reasons"] += failed_checks(run.result["checks"])
                for name, b in run.result.get("bench", {}).items():
                    if b.get("error") or b.get("flags"):
                        if side == "B":
                            verdict["reasons"].append(f"benchmark {name}: {b.get('error') or b['flags']}")
                    blocks[side].setdefault(name, []).append(b.get("block_medians", []))
                if verdict["reasons"]:
                    return verdict
        metrics = {s: {**check_metrics(checks.get(s, {})), **bench_metrics(blocks[s])} for s in ("A", "B")}
        verdict["metrics"] = metrics
        for c in g.criteria:
            res = fb_goals.evaluate(c.name, c.expr, metrics["B"])
            verdict["criteria"].append(res)
            if not res["passed"]:
                value = "" if res["value"] is None else f" (value {res['value']:.4g})"
                verdict["reasons"].append(f"criterion {c.name!r} does not hold: {c.expr}{value} "
                                          f"{res['error'] or ''}".rstrip())
        for t in g.targets:
            verdict["targets"].append(self._target(t, blocks, metrics, verdict["reasons"]))
        verdict["passed"] = not verdict["reasons"]
        return verdict

    def _target(self, t, blocks, metrics, reasons) -> dict:
        g = self.goals
        if t.metric in blocks["A"] and t.metric in blocks["B"]:
            ab = stats.compare_blocks(blocks["A"][t.metric], blocks["B"][t.metric], t.direction, g.min_effect)
            if ab.verdict != "better":
                reasons.append(f"target {t.metric}: no improvement beyond the noise floor ({ab.summary()})")
            return {"metric": t.metric, **ab.to_dict(), "summary": ab.summary()}
        a, b = metrics["A"].get(t.metric), metrics["B"].get(t.metric)
        if a is None or b is None:
            reasons.append(f"target {t.metric} was not measured")
            return {"metric": t.metric, "verdict": "not measured"}
        # Check figures are deterministic for a fixed seed: no noise floor beyond min_effect.
        change = ((a - b) if t.direction == "lower" else (b - a)) / abs(a) if a else 0.0
        better = change > g.min_effect
        if not better:
            reasons.append(f"target {t.metric}: {a:.4g} -> {b:.4g} is no improvement beyond min_effect "
                           f"{g.min_effect:g} (within the noise)")
        verdict = "better" if better else "no difference"
        return {"metric": t.metric, "baseline": a, "candidate": b, "change": change, "verdict": verdict,
                "summary": f"{verdict}: baseline {a:.4g}, candidate {b:.4g} ({100 * change:+.1f}% better, "
                           f"same seed; min_effect {100 * g.min_effect:g}%)"}
