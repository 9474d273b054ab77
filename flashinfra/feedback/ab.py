"""A/B experiments between two git revisions: ``flashinfra ab --a REV --b REV --bench NAME``.

Each revision is checked out in its own detached git worktree. Every run is a fresh subprocess,
``python -m flashinfra.feedback.bench NAME --json`` started in that worktree (so it imports that revision's
code, which is verified from the report), giving one median over its timed calls. Runs are interleaved
in rounds of three, A, B and A' (a second run of A), in an order that rotates from round to round, so
slow phases of the machine hit both sides alike. The verdict is ``flashinfra.feedback.stats.compare_rounds``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from flashinfra.feedback import stats

ORDERS = (("A", "B", "A'"), ("B", "A'", "A"), ("A'", "A", "B"))


class ABError(RuntimeError):
    """The experiment could not be run (bad revision, failing benchmark...)."""


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ABError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def resolve(repo: Path, rev: str) -> str:
    return _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")


class Worktrees:
    """Detached worktrees of the given commits under a temporary folder, removed on exit."""

    def __init__(self, repo: Path, commits: dict[str, str]):
        self.repo, self.commits = repo, commits
        self.root = Path(tempfile.mkdtemp(prefix="flashinfra-ab-"))
        self.paths: dict[str, Path] = {}

    def __enter__(self) -> dict[str, Path]:
        try:
            for label, sha in self.commits.items():
                path = self.root / label
                _git(self.repo, "worktree", "add", "--detach", str(path), sha)
                self.paths[label] = path
        except BaseException:
            self.__exit__()
            raise
        return self.paths

    def __exit__(self, *exc) -> None:
        for path in self.paths.values():
            subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(path)],
                           capture_output=True)
        subprocess.run(["git", "-C", str(self.repo), "worktree", "prune"], capture_output=True)
        if self.root.exists():
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)


def run_once(worktree: Path, bench: str, bench_args: list[str], timeout_s: float) -> dict[str, Any]:
    """One subprocess run of the benchmark in ``worktree``; returns its result entry."""
    cmd = [sys.executable, "-m", "flashinfra.feedback.bench", bench, "--json", "--no-roofline", *bench_args]
    # `python -m` puts the working directory first on sys.path: the worktree's flashinfra is imported.
    proc = subprocess.run(cmd, cwd=worktree, capture_output=True, text=True, timeout=timeout_s)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ABError(f"benchmark run in {worktree} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    source = Path(report.get("source", "")).resolve()
    if source != (worktree / "flashinfra").resolve():
        raise ABError(f"run in {worktree} imported flashinfra from {source}, not from its worktree")
    results = [r for r in report["benchmarks"] if r["name"] == bench]
    if len(results) != 1 or "error" in results[0]:
        raise ABError(f"benchmark {bench!r} in {worktree}: {results or report['benchmarks']}")
    return results[0]


def run_ab(repo: str | Path, rev_a: str, rev_b: str, bench: str, rounds: int = 8, bench_args: list[str] = (),
           min_effect: float = 0.02, timeout_s: float = 600.0, log=None) -> dict[str, Any]:
    """Run the experiment and return the verdict with every run's figures."""
    if rounds < 3:
        raise ValueError("an A/B experiment needs at least 3 rounds")
    repo = Path(repo).resolve()
    commits = {}
    for label, rev in (("a", rev_a), ("b", rev_b)):
        try:
            commits[label] = resolve(repo, rev)
        except ABError:
            raise ABError(f"{rev!r} is not a commit of {repo}") from None
    times: dict[str, list[float]] = {"A": [], "B": [], "A'": []}
    flags: dict[str, set[str]] = {"A": set(), "B": set(), "A'": set()}
    with Worktrees(repo, commits) as trees:
        where = {"A": trees["a"], "A'": trees["a"], "B": trees["b"]}
        for r in range(rounds):
            for label in ORDERS[r % len(ORDERS)]:
                result = run_once(where[label], bench, list(bench_args), timeout_s)
                times[label].append(result["median_s"])
                flags[label].update(result["flags"])
                if log is not None:
                    log(f"round {r + 1}/{rounds} {label}: {result['median_s'] * 1e6:.1f} us")
    out = stats.compare_rounds(times["A"], times["B"], times["A'"], min_effect=min_effect)
    out.update(bench=bench, a=rev_a, b=rev_b, commit_a=commits["a"], commit_b=commits["b"],
               runs={k: v for k, v in times.items()}, flags={k: sorted(v) for k, v in flags.items()})
    return out


def format_text(r: dict[str, Any]) -> str:
    return (f"{r['bench']}: B ({r['b']}) vs A ({r['a']}): {r['verdict'].upper()}, "
            f"confidence {100 * r['confidence']:.0f}%\n"
            f"  B/A = {r['ratio_b_over_a']:.3f} (95% CI {r['ratio_ci95'][0]:.3f}..{r['ratio_ci95'][1]:.3f}), "
            f"Mann-Whitney p = {r['mann_whitney_p']:.3g}\n"
            f"  A/A = {r['aa_ratio']:.3f} (95% CI {r['aa_ci95'][0]:.3f}..{r['aa_ci95'][1]:.3f}): noise floor "
            f"{100 * r['noise_floor']:.1f}%, threshold {100 * r['threshold']:.1f}%\n"
            f"  median A {r['median_a_s'] * 1e6:.1f} us, B {r['median_b_s'] * 1e6:.1f} us over {r['rounds']} rounds"
            + (f"\n  flags: {r['flags']}" if any(r["flags"].values()) else "")
            + (f"\n  warning: A/A runs differ by up to {100 * r['noise_floor']:.0f}%; this machine cannot resolve "
               "smaller changes (other load? fewer rounds than needed?)" if r["noise_floor"] > 0.2 else ""))


def cli_main(args) -> int:
    bench_args = ["--dtype", args.dtype]
    if args.device:
        bench_args += ["--device", args.device]
    if args.quick:
        bench_args.append("--quick")
    if args.runs:
        bench_args += ["--runs", str(args.runs)]
    for provider in args.provider:
        bench_args += ["--provider", provider]
    if args.no_default_providers:
        bench_args.append("--no-default-providers")
    log = None if args.json else (lambda line: print(line, file=sys.stderr))
    try:
        result = run_ab(args.repo, args.a, args.b, args.bench, rounds=args.rounds, bench_args=bench_args,
                        min_effect=args.min_effect, log=log)
    except (ABError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_text(result))
    return 0
