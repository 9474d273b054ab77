import json

from flashinfra import cli
from flashinfra.feedback.goals import check_file, evaluate

BENCH_REPORT = {"device": "cpu", "benchmarks": [
    {"name": "prefill_alone", "median_s": 0.100, "p90_s": 0.110},
    {"name": "prefill_with_transfer", "median_s": 0.103, "p90_s": 0.140},
]}


def _write(tmp_path, toml):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bench.json").write_text(json.dumps(BENCH_REPORT))
    (tmp_path / "results" / "serve.json").write_text(json.dumps({"decode": {"tokens_per_s": 900.0}}))
    path = tmp_path / "goals.toml"
    path.write_text(toml)
    return path


GOALS = """
[sources]
bench = "results/bench.json"
serve = "results/serve.json"

[metrics]
decode_tps = "serve.decode.tokens_per_s"
decode_tps_before = 1000.0

[[criterion]]
name = "transfer overhead"
expr = "prefill_with_transfer / prefill_alone <= 1.05"

[[criterion]]
name = "decode throughput kept"
metric = "decode_tps"
op = ">="
threshold = 0.95
baseline = "decode_tps_before"
"""


def test_one_met_one_unmet(tmp_path):
    report = check_file(_write(tmp_path, GOALS))
    assert report["error"] is None and not report["passed"]
    met, unmet = report["criteria"]
    assert met["verdict"] == "met" and abs(met["value"] - 1.03) < 1e-12 and met["threshold"] == 1.05
    assert met["metrics"] == {"prefill_with_transfer": 0.103, "prefill_alone": 0.1}
    assert unmet["verdict"] == "unmet" and abs(unmet["value"] - 0.9) < 1e-12 and unmet["threshold"] == 0.95
    assert (report["met"], report["unmet"], report["errors"]) == (1, 1, 0)


def test_cli_prints_json_verdicts_and_exit_code(tmp_path, capsys):
    path = _write(tmp_path, GOALS)
    assert cli.main(["goals", "check", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in report["criteria"]] == ["met", "unmet"]
    path.write_text(GOALS.replace("threshold = 0.95", "threshold = 0.85"))
    assert cli.main(["goals", "check", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]


def test_missing_metric_and_bad_expression_are_errors_with_reasons(tmp_path):
    toml = GOALS + '\n[[criterion]]\nname = "typo"\nexpr = "prefill_alone.p99_s < 1"\n' \
                   '\n[[criterion]]\nname = "call"\nexpr = "__import__(\'os\') < 1"\n'
    report = check_file(_write(tmp_path, toml))
    typo, call = report["criteria"][2:]
    assert typo["verdict"] == "error" and "prefill_alone.p99_s" in typo["error"]
    assert call["verdict"] == "error" and "unsupported" in call["error"]
    assert report["errors"] == 2 and not report["passed"]


def test_file_level_errors_still_give_a_verdict(tmp_path):
    report = check_file(_write(tmp_path, GOALS.replace("results/serve.json", "results/nope.json")))
    assert not report["passed"] and "nope.json" in report["error"]
    (tmp_path / "bad.toml").write_text("[[criterion]\n")
    assert "TOMLDecodeError" in check_file(tmp_path / "bad.toml")["error"]


def test_expression_features():
    m = {"a": 2.0, "b.c": 4.0}
    assert evaluate("x", "1 < a * 2 <= b.c", m)["verdict"] == "met"
    assert evaluate("x", "max(a, b.c) == 4 and not a > 3", m)["verdict"] == "met"
    assert evaluate("x", "a / (b.c - 4) < 1", m)["error"] == "division by zero"
    assert evaluate("x", "a + 1", m)["verdict"] == "error"
