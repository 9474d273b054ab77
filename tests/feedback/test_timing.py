"""The bench scripts' timing helpers: medians on the CPU, the results header and the results file."""

import json
import time

import pytest

from flashinfra.feedback import timing


def test_time_eager_measures_the_call_on_the_cpu():
    us = timing.time_eager(lambda: time.sleep(0.002), iters=5, warmup=1, device="cpu")
    assert 2000 <= us < 200_000
    fast = timing.time_eager(lambda: None, iters=5, warmup=1, device="cpu")
    assert fast < us


def test_time_stream_divides_by_the_calls():
    calls = []
    us = timing.time_stream(lambda: (calls.append(1), time.sleep(0.001)), calls=4, iters=3, device="cpu")
    assert len(calls) == 1 + 4 * 3  # one warm-up call, then three timings of four calls
    assert 1000 <= us < 100_000


def test_header_has_the_fields_a_result_needs():
    h = timing.header(["bench/x.py", "--flag"])
    assert h["command"].endswith("bench/x.py --flag")
    assert h["device"] and h["date"].endswith("+00:00")
    assert h["machine"]["cpu_count"] >= 1


def test_write_results_round_trips_and_copies(tmp_path):
    res = timing.header(["bench/x.py"]) | {"rows": [{"ours_ms": 1.5, "fla_ms": 3.0, "speedup_vs_fla": 2.0}]}
    path = timing.write_results("x", res, copy_to=str(tmp_path / "copy"), directory=tmp_path / "results")
    assert path == tmp_path / "results" / "x.json"
    assert json.loads(path.read_text()) == json.loads((tmp_path / "copy" / "x.json").read_text())
    assert json.loads(path.read_text())["rows"][0]["speedup_vs_fla"] == 2.0


@pytest.mark.parametrize("field", timing.REQUIRED_FIELDS)
def test_write_results_refuses_a_result_without_its_origin(tmp_path, field):
    res = timing.header(["bench/x.py"])
    del res[field]
    with pytest.raises(ValueError, match=field):
        timing.write_results("x", res, directory=tmp_path)
    assert not (tmp_path / "x.json").exists()


def test_results_dir_is_the_source_trees():
    assert timing.results_dir().parts[-2:] == ("bench", "results")
    assert (timing.results_dir().parent / "README.md").exists()


def test_kernel_times_name_each_operator_per_call():
    import torch

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    calls = []
    times = timing.kernel_times_us(lambda: (calls.append(1), torch.mm(a, b), torch.relu(a)), calls=3, warmup=1,
                                   device="cpu")
    assert len(calls) == 4
    assert "aten::mm" in times and times["aten::mm"] > 0
    assert list(times.values()) == sorted(times.values(), reverse=True)
