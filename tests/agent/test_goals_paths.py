"""Goals file parsing and validation; repository confinement and guardrails."""

import os
import textwrap

import pytest

from flashinfra.agent.campaign_goals import GoalsError, load_goals
from flashinfra.agent.paths import Guardrails, PathError, confine, glob_match

GOOD = """
[campaign]
name = "c1"
providers = ["pkg.checks"]
[[target]]
metric = "bench.x"
[[criterion]]
name = "ratio"
metric = "a"
op = "<="
threshold = 1.05
baseline = "b"
[guardrails]
editable = ["pkg/**"]
read_only = ["pkg/protocol.py"]
[budgets]
iterations = 3
"""


def _write(tmp_path, text, name="goals.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_goals_parse_and_always_read_only(tmp_path):
    goals = load_goals(_write(tmp_path, GOOD))
    assert goals.name == "c1" and goals.budgets.iterations == 3 and goals.budgets.tokens == 400_000
    assert goals.criteria[0].expr == "a / b <= 1.05"
    assert goals.targets[0].direction == "lower"
    patterns = goals.read_only_patterns(tmp_path)
    rails = Guardrails(goals.editable, patterns)
    assert rails.why_not_editable("pkg/kernel.py") is None
    for path in ("goals.toml", "pkg/checks.py", "pkg/checks/sub.py", "tests/test_x.py", "pkg/tests/t.py",
                 "pkg/protocol.py", "bench/run.py", "pyproject.toml"):
        assert "read-only" in rails.why_not_editable(path), path
    assert "outside the editable" in rails.why_not_editable("other/x.py")


@pytest.mark.parametrize("change, message", [
    (("[guardrails]\neditable = [\"pkg/**\"]", "[guardrails]\neditable = []"), "guardrails.editable"),
    (("[[target]]\nmetric = \"bench.x\"", "[[target]]\nmetric = \"bench.x\"\ndirection = \"up\""), "direction"),
    (("iterations = 3", "iterations = 0"), "budgets.iterations"),
    (("name = \"c1\"", "name = \"a b\""), "campaign.name"),
    (("op = \"<=\"", "op = \"=<\""), "op must be one of"),
    (("[budgets]", "[budget]"), "unknown sections"),
])
def test_goals_errors_name_the_field(tmp_path, change, message):
    old, new = change
    assert old in GOOD
    with pytest.raises(GoalsError, match=message):
        load_goals(_write(tmp_path, GOOD.replace(old, new)))


def test_goals_missing_and_malformed(tmp_path):
    with pytest.raises(GoalsError, match="does not exist"):
        load_goals(tmp_path / "nope.toml")
    with pytest.raises(GoalsError, match="not valid TOML"):
        load_goals(_write(tmp_path, "[campaign\n"))


def test_confine_rejects_escapes(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x")
    (tmp_path / "secret").write_text("s")
    os.symlink(tmp_path / "secret", root / "pkg" / "leak")
    os.symlink(tmp_path, root / "up")
    os.symlink(root / "pkg" / "a.py", root / "pkg" / "inside")
    assert confine(root, "pkg/a.py") == (root / "pkg/a.py").resolve()
    assert confine(root, "pkg/inside") == (root / "pkg/a.py").resolve()
    for bad, why in [("/etc/passwd", "absolute"), ("../secret", "'..'"), ("pkg/../../secret", "'..'"),
                     ("pkg/leak", "symlink leading outside"), ("up/secret", "symlink leading outside"),
                     (".git/config", ".git"), ("", "invalid")]:
        with pytest.raises(PathError, match=why):
            confine(root, bad)
    with pytest.raises(FileNotFoundError):
        confine(root, "pkg/missing.py", must_exist=True)


def test_glob_match():
    assert glob_match("pkg/**", "pkg/a/b.py") and glob_match("**/checks.py", "checks.py")
    assert glob_match("**/checks.py", "a/b/checks.py") and glob_match("tests", "tests/x/y.py")
    assert not glob_match("pkg/*.py", "pkg/a/b.py") and glob_match("pkg/*.py", "pkg/b.py")
    assert not glob_match("*.toml", "a/b.toml") and not glob_match("pkg/**", "pkgx/a.py")
