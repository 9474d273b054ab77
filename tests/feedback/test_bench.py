"""The benchmark runner: timing figures, roofline fractions, re-checks and the cached-output flag."""

import json
import sys

import pytest
import torch

from flashinfra import cli
from flashinfra.feedback import bench, ceilings
from flashinfra.feedback.registry import BenchContext, BenchSpec, compare, register_benchmark


def _inputs(seed):
    return (torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)),)


def _spec(fn, check=True):
    return BenchSpec(fn=fn, make_inputs=_inputs, bytes=2 * 64 * 64 * 4, flops=64 * 64,
                     check=(lambda inputs, out: compare("double", out, 2 * inputs[0].double())) if check else None)


def test_honest_op_is_not_flagged():
    r = bench.run_spec("honest", _spec(lambda x: 2 * x), "cpu", runs=8, warmup=1)
    assert r["flags"] == [] and r["passed"]
    assert r["runs"] == 8 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
    assert r["check"][0]["passed"]


def test_cached_result_is_flagged():
    memo = {}

    def cached_double(x):  # computes once, then returns the first result for any input
        if "out" not in memo:
            memo["out"] = 2 * x
        return memo["out"]

    r = bench.run_spec("cached", _spec(cached_double), "cpu", runs=8, warmup=1)
    assert "cached" in r["flags"] and "wrong_output" in r["flags"] and not r["passed"]
    assert r["check"][0]["num_bad"] > 0


def test_seed_ignoring_inputs_are_flagged_not_called_cached():
    spec = BenchSpec(fn=lambda x: 2 * x, make_inputs=lambda seed: _inputs(0))
    r = bench.run_spec("stale", spec, "cpu", runs=4, warmup=0)
    assert r["flags"] == ["inputs_not_fresh"]


def test_wrong_output_is_flagged():
    r = bench.run_spec("wrong", _spec(lambda x: 2 * x + 1e-2), "cpu", runs=3, warmup=0)
    assert r["flags"] == ["wrong_output"]


def test_quick_ceilings_and_fractions(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFRA_CACHE", str(tmp_path))
    c = ceilings.measure("cpu", quick=True)
    assert c["copy_bytes_per_s"] > 1e6 and c["matmul_flops_per_s"] > 1e6
    ceilings.save(c)
    assert ceilings.load("cpu") == c
    r = bench.run_spec("honest", _spec(lambda x: 2 * x), "cpu", runs=3, warmup=0, ceilings=c)
    assert r["frac_copy_bandwidth"] == pytest.approx(r["bytes_per_s"] / c["copy_bytes_per_s"])
    assert r["bound"] in ("memory", "compute")


@register_benchmark("planted.cached_matmul", tags=("planted",))
def bench_cached_matmul(ctx: BenchContext) -> BenchSpec:
    memo = []

    def fn(a, b):
        if not memo:
            memo.append(a @ b)
        return memo[0]

    def make_inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(33, 17, generator=g), torch.randn(17, 9, generator=g)

    return BenchSpec(fn=fn, make_inputs=make_inputs, bytes=(33 * 17 + 17 * 9 + 33 * 9) * 4, flops=2 * 33 * 17 * 9)


def test_cli_bench_json_flags_cached_and_runs_builtin(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHINFRA_CACHE", str(tmp_path))
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "planted.cached_matmul", "kda.decode", "--quick", "--device", "cpu", "--dtype",
                   "float32", "--runs", "4", "--json", "--output", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text())["benchmarks"] == report["benchmarks"]
    by_name = {r["name"]: r for r in report["benchmarks"]}
    assert rc == 1
    assert by_name["planted.cached_matmul"]["flags"] == ["cached"]
    assert by_name["kda.decode"]["passed"], by_name["kda.decode"]
    assert by_name["kda.decode"]["check"][0]["passed"]
    assert "frac_copy_bandwidth" in by_name["kda.decode"]


def test_bench_serve_forwards_arguments(monkeypatch):
    bench_serve = pytest.importorskip("flashinfra.server.bench_serve")
    seen = []
    monkeypatch.setattr(bench_serve, "main", lambda argv: seen.append(argv) or 7)
    assert cli.main(["bench", "serve", "--num-prompts", "3", "--json"]) == 7
    assert seen == [["--num-prompts", "3", "--json"]]


def test_bench_serve_absent_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfra.server.bench_serve", None)
    assert cli.main(["bench", "serve", "--x"]) == 2
    assert "bench_serve" in capsys.readouterr().err


def test_in_place_op_returning_none_is_judged_by_its_arguments():
    def make_inputs(seed):
        return torch.empty(8), torch.randn(8, generator=torch.Generator().manual_seed(seed))

    def double_into(out, x):
        out.copy_(2 * x)

    r = bench.run_spec("inplace", BenchSpec(fn=double_into, make_inputs=make_inputs), "cpu", runs=4, warmup=0)
    assert r["flags"] == []


def test_check_result_json_is_strict():
    r = compare("nan", torch.tensor([float("nan")]), torch.tensor([1.0], dtype=torch.float64))
    text = json.dumps(r.to_dict(), allow_nan=False)
    assert '"worst_out": "nan"' in text and '"max_abs": "inf"' in text


def _hold_gil(n):
    return sum(range(n))  # one C call holding the GIL


@register_benchmark("planted.gil_hog", tags=("planted",))
def bench_gil_hog(ctx: BenchContext) -> BenchSpec:
    return BenchSpec(fn=_hold_gil, make_inputs=lambda seed: (3 * 10**7 + seed,))


def test_bench_under_gil_probe_names_the_culprit(tmp_path, capsys):
    assert cli.main(["bench", "planted.gil_hog", "--device", "cpu", "--runs", "2", "--no-roofline",
                     "--gil-probe-ms", "100", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["benchmarks"]
    stalls = r["gil_stalls"]
    assert stalls["count"] >= 1 and stalls["max_s"] >= 0.1
    assert any("in _hold_gil: return sum(range(n))" in c for c in stalls["culprits"]), stalls
