import json

import pytest

from flashinfra import cli
from flashinfra.feedback.trace import STEP_PREFIX, format_text, summarize_trace


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def test_summary_of_a_launch_bound_gpu_trace():
    """Two steps; step 0 launches two short kernels far apart (idle GPU), step 1 one long kernel."""
    ev = [_x("user_annotation", STEP_PREFIX + "0", 0, 100), _x("user_annotation", STEP_PREFIX + "1", 100, 50),
          _x("cpu_op", "aten::mm", 10, 40), _x("cpu_op", "aten::copy_", 20, 10),
          _x("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=1),
          _x("cuda_runtime", "cudaLaunchKernel", 60, 2, correlation=2),
          _x("cuda_runtime", "cudaLaunchKernel", 110, 2, correlation=3),
          {**_x("kernel", "gemm", 15, 5, correlation=1), "pid": 0, "tid": 7},
          {**_x("kernel", "gemm", 65, 5, correlation=2), "pid": 0, "tid": 7},
          {**_x("kernel", "softmax", 120, 30, correlation=3), "pid": 0, "tid": 8}]
    s = summarize_trace({"traceEvents": ev})
    assert s["kernels"] == 3
    assert s["gpu_busy_s"] == pytest.approx(40e-6) and s["gpu_window_s"] == pytest.approx(135e-6)
    gaps = s["idle_gaps"]
    assert gaps["count"] == 2 and gaps["total_s"] == pytest.approx(95e-6)
    assert gaps["largest"][0] == {"gap_s": pytest.approx(50e-6), "at_s": pytest.approx(55e-6),
                                  "after": "gemm", "before": "softmax"}
    assert [k["name"] for k in s["top_kernels"]] == ["softmax", "gemm"]
    assert s["top_kernels"][1]["count"] == 2
    mm = next(o for o in s["top_cpu_ops"] if o["name"] == "aten::mm")
    assert mm["self_s"] == pytest.approx(30e-6) and mm["total_s"] == pytest.approx(40e-6)
    assert [(r["kernels"], r["gpu_s"]) for r in s["steps"]] == [(2, pytest.approx(10e-6)), (1, pytest.approx(30e-6))]
    assert s["diagnosis"].startswith("launch-bound")
    assert "gemm -> softmax" in format_text(s)


def test_trace_a_benchmark_on_cpu(tmp_path, capsys):
    prefix = tmp_path / "t"
    assert cli.main(["trace", "--bench", "kda.decode", "--quick", "--dtype", "float32", "--device", "cpu",
                     "--steps", "3", "--out", str(prefix)]) == 0
    summary = json.loads((tmp_path / "t.summary.json").read_text())
    assert [r["step"] for r in summary["steps"]] == ["0", "1", "2"]
    assert all(r["cpu_s"] > 0 for r in summary["steps"])
    assert summary["kernels"] == 0 and summary["top_cpu_ops"]
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert "top CPU ops" in (tmp_path / "t.txt").read_text()


def test_trace_engine_steps_on_a_tiny_checkpoint(tmp_path):
    from flashinfra.model.factory import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    prefix = tmp_path / "e"
    assert cli.main(["trace", "--model", str(ckpt), "--device", "cpu", "--dtype", "float32", "--steps", "2",
                     "--prompt-lens", "5,3", "--out", str(prefix)]) == 0
    summary = json.loads((tmp_path / "e.summary.json").read_text())
    assert len(summary["steps"]) == 2
    assert any(o["name"] in ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear") for o in summary["top_cpu_ops"])


def test_trace_arrivals_mix_new_prompts_into_decode_steps(tmp_path):
    from flashinfra.feedback.trace import _engine_step
    from flashinfra.model.factory import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "ckpt")
    step = _engine_step(str(ckpt), "cpu", "float32", [5, 3], max_tokens=8, options={"max_num_seqs": 8},
                        arrivals=(2, 4))
    first = {o.request_id for o in step(0)}
    assert first == {"trace-0-0", "trace-0-1"}
    # each later step decodes the running rows and prefills the two prompts that joined just before it
    for i in (1, 2):
        ids = {o.request_id for o in step(i)}
        assert {f"trace-{i}-0", f"trace-{i}-1", "trace-0-0", "trace-0-1"} <= ids
    assert cli.main(["trace", "--model", str(ckpt), "--device", "cpu", "--arrivals", "2", "--out",
                     str(tmp_path / "x")]) == 2


def test_trace_needs_exactly_one_target(capsys):
    assert cli.main(["trace"]) == 2
    assert cli.main(["trace", "--bench", "no.such.bench", "--device", "cpu"]) == 2
    assert cli.main(["trace", "--model", "/no/such/checkpoint", "--device", "cpu"]) == 2
