"""Checks, including the planted off-by-one kernel that the check must locate."""

import json

import torch

from flashinfra import cli
from flashinfra.feedback import check
from flashinfra.feedback.registry import compare, register_check


def rowwise_scale_off_by_one(x: torch.Tensor) -> torch.Tensor:
    """A 'kernel' writing out[i, j] = 2 * x[i, j] with a loop bound off by one: the last column is
    never written."""
    out = torch.full_like(x, float("nan"))  # poisoned before the run
    for j in range(x.shape[1] - 1):
        out[:, j] = 2 * x[:, j]
    return out


def shifted_read(x: torch.Tensor) -> torch.Tensor:
    """Reads one row too far from row 5 on: rows 5.. are wrong values, not NaN."""
    out = 2 * x.clone()
    out[5:-1] = 2 * x[6:]
    return out


@register_check("planted.offbyone", tags=("planted",))
def check_planted():
    x = torch.randn(13, 7)
    return [compare("planted.offbyone.loop_bound", rowwise_scale_off_by_one(x), 2 * x.double()),
            compare("planted.offbyone.shifted_read", shifted_read(x), 2 * x.double())]


@register_check("planted.raises")
def check_raises():
    raise RuntimeError("kernel launch failed")


def test_off_by_one_is_reported_with_its_location():
    runs, errors, seed = check.run_checks(["planted.offbyone"], seed=3)
    assert errors == []
    (run,) = runs
    assert not run.passed
    loop, shifted = run.results
    assert loop.num_bad == 13 and loop.num_nonfinite == 13
    assert loop.bad_extent == [(0, 12), (6, 6)]  # every row, only the last column
    assert loop.bad_indices[0] == (0, 6)
    assert not shifted.passed and shifted.bad_extent[0] == (5, 11)  # rows 5..11, the last row is right
    assert shifted.max_abs > 0.01 and shifted.worst_index[0] in range(5, 12)
    text = check.format_text(runs, errors, seed)
    assert "FAIL planted.offbyone" in text and "extent 0..12 x 6..6" in text


def test_exception_in_check_is_a_failure_not_a_crash():
    runs, _, _ = check.run_checks(["planted.raises", "kda.gate"], seed=1)
    by_name = {r.name: r for r in runs}
    assert not by_name["planted.raises"].passed
    assert "kernel launch failed" in by_name["planted.raises"].error
    assert by_name["kda.gate"].passed


def test_builtin_gate_and_ceiling_checks_pass():
    runs, errors, _ = check.run_checks(["kda.gate", "ceilings"])
    assert errors == []
    assert runs and all(r.passed for r in runs), check.format_text(runs, errors, 0)


def test_cli_check_json(capsys):
    rc = cli.main(["check", "planted.offbyone", "kda.gate", "--json", "--seed", "5"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["seed"] == 5 and not report["passed"]
    planted = next(c for c in report["checks"] if c["name"] == "planted.offbyone")
    assert planted["results"][0]["bad_extent"] == [[0, 12], [6, 6]]
    assert cli.main(["check", "kda.gate"]) == 0
    assert cli.main(["check", "no.such.check"]) == 2


def test_cli_lists_checks_and_loads_extra_providers(tmp_path, monkeypatch, capsys):
    (tmp_path / "extra_checks_mod.py").write_text(
        "import torch\n"
        "from flashinfra.feedback.registry import compare, register_check\n"
        "@register_check('extra.zero', tags=('extra',))\n"
        "def zero():\n"
        "    return compare('extra.zero', torch.zeros(3), torch.zeros(3, dtype=torch.float64))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["check", "extra", "--provider", "extra_checks_mod"]) == 0
    assert "PASS extra.zero" in capsys.readouterr().out
    assert cli.main(["check", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "kda.gate\tkernel,kda\tflashinfra.kernels.kda.checks" in listing and "extra.zero" in listing


def test_op_checks_hold_the_triton_kernels_under_the_interpreter(tmp_path):
    """The same checks, with the ops dispatching to their Triton kernels (run by Triton's CPU interpreter in a
    child process, as the variable must be set before Triton starts)."""
    import subprocess
    import sys

    from flashinfra import env

    code = ("import json, torch\n"
            "from flashinfra.kernels.dispatch import use_triton\n"
            "from flashinfra.feedback import check\n"
            "assert use_triton(torch.zeros(1)), 'ops would run their references'\n"
            "runs, errors, seed = check.run_checks(['kda.gate', 'kda.prefill_recurrence', 'kda.conv1d_window'])\n"
            "print(json.dumps(check.to_json(runs, errors, seed)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env.triton_interpreter_environ(), "FLASHINFRA_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["passed"], proc.stdout[-3000:]
    assert {c["name"] for c in report["checks"]} == {"kda.conv1d_window", "kda.gate", "kda.prefill_recurrence"}
