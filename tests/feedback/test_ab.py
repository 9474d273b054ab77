"""A/B experiments on a throwaway git repository whose benchmark does 4x the work in revision B (4x rather than 2x:
on a shared two-core machine the A/A noise floor has reached 34%, which a 2x slowdown only just clears)."""

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

import flashinfra
from flashinfra import cli
from flashinfra.feedback import ab
from flashinfra.feedback import stats
from flashinfra.feedback.stats import mann_whitney

PACKAGE_FILES = ["__init__.py", "env.py", "feedback/__init__.py", "feedback/registry.py", "feedback/bench.py"]

TOY = """
from flashinfra.feedback.registry import BenchSpec, register_benchmark

N = {n}


def spin(seed):
    s = seed
    for i in range(N):
        s = (s * 31 + i) % 1000003
    return s


@register_benchmark("toy.spin")
def bench_spin(ctx):
    return BenchSpec(fn=spin, make_inputs=lambda seed: (seed,), flops=N)
"""


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def toy_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("toyrepo")
    src = Path(flashinfra.__file__).parent
    for rel in PACKAGE_FILES:
        (repo / "flashinfra" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, repo / "flashinfra" / rel)
    _git(repo, "init", "-q")
    (repo / "toybench.py").write_text(TOY.format(n=20000))
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "baseline")
    _git(repo, "tag", "fast")
    (repo / "toybench.py").write_text(TOY.format(n=80000))
    _git(repo, "commit", "-q", "-am", "four times the work")
    return repo


BENCH_ARGS = ["--device", "cpu", "--runs", "15", "--provider", "toybench", "--no-default-providers"]


def test_aa_says_no_difference(toy_repo):
    r = ab.run_ab(toy_repo, "fast", "fast", "toy.spin", rounds=8, bench_args=BENCH_ARGS)
    assert r["verdict"] == "no difference", ab.format_text(r)
    assert r["commit_a"] == r["commit_b"] and len(r["runs"]["B"]) == 8
    assert 0.5 < r["ratio_b_over_a"] < 1.5


def test_4x_slowdown_says_slower(toy_repo, capsys):
    rc = cli.main(["ab", "--repo", str(toy_repo), "--a", "fast", "--b", "HEAD", "--bench", "toy.spin",
                   "--rounds", "8", "--json", "--device", "cpu", "--runs", "15", "--provider", "toybench",
                   "--no-default-providers"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert r["verdict"] == "slower", r
    # B does four times the work; the ratio is not pinned to 4 because other processes share the machine.
    assert r["ratio_b_over_a"] > 2 and r["confidence"] > 0.9
    assert r["ratio_ci95"][0] > 1 + r["threshold"]
    assert r["flags"] == {"A": [], "B": [], "A'": []}
    assert "worktree" not in subprocess.run(["git", "-C", str(toy_repo), "worktree", "list"],
                                            capture_output=True, text=True).stdout.split("\n", 1)[-1]


def test_bad_revision_is_a_clear_error(toy_repo, capsys):
    assert cli.main(["ab", "--repo", str(toy_repo), "--a", "nope", "--b", "HEAD", "--bench", "toy.spin"]) == 2
    assert "'nope' is not a commit" in capsys.readouterr().err


def test_verdict_statistic_directions():
    a = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0]
    a2 = [1.01, 1.0, 1.0, 0.99, 1.0, 1.02]
    assert stats.compare_rounds(a, [x * 0.5 for x in a2], a2)["verdict"] == "faster"
    assert stats.compare_rounds(a, [x * 1.5 for x in a2], a2)["verdict"] == "slower"
    assert stats.compare_rounds(a, a2, a)["verdict"] == "no difference"
    # A noisy machine raises the bar: a 10% change inside a 30% A/A spread is no difference.
    noisy = [1.0, 1.3, 0.8, 1.25, 0.75, 1.2]
    noisy_a2 = [x * y for x, y in zip(a, noisy)]
    assert stats.compare_rounds(a, [x * 1.1 for x in a], noisy_a2)["verdict"] == "no difference"


def test_mann_whitney_exact_p():
    r = mann_whitney([7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6])
    assert r["auc"] == 1.0 and r["p_value"] == pytest.approx(2 / math.comb(12, 6))
