"""``bench/context_parallel.py --smoke`` runs the tiny model on 1 and 2 CPU ranks (torchrun, gloo) and writes one JSON
per world size: the prefill timed on rank 0, every rank's memory, the 2-rank prefill split (collectives counted)
and set beside the one-rank run, and Layer Split's cache capacity above full replication at 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "context_parallel.py"

pytestmark = pytest.mark.slow


def test_bench_smoke_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--smoke", "--warmup", "0", "--model-dir", str(tmp_path / "model"),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    runs = {n: json.loads((tmp_path / "out" / f"context_parallel_{n}gpu_smoke.json").read_text()) for n in (1, 2)}
    for n, out in runs.items():
        assert out["device"] and out["command"] and out["date"]
        run = out["run"]
        assert run["gpus"] == n and run["engine"]["context_parallel_size"] == n
        assert run["ttft_s"] > 0 and run["tokens_per_s"] > 0 and run["steps"] >= 2 and run["flops"] > 0
        assert run["prefill"]["tokens"] == run["engine"]["max_model_len"] - 16
        assert len(run["ranks"]) == n
        for rank in run["ranks"]:
            assert rank["host_peak_bytes"] > 0 and "device_peak_bytes" in rank
        cap = run["capacity"]
        assert cap["budget_bytes_per_rank"] > 0 and cap["tokens_per_rank"]["replicated"] > 0
        assert len(out["table"]) == 4
    one, two = runs[1]["run"], runs[2]["run"]
    assert one["collectives"] == 0 and two["collectives"] > 0  # the 2-rank prefill was split
    assert one["one_gpu"] is None and two["one_gpu"]["ttft_s"] == one["ttft_s"] and two["one_gpu"]["speedup"] > 0
    assert "layer_split" not in one["capacity"]["tokens_per_rank"]
    tokens, released = two["capacity"]["tokens_per_rank"], two["capacity"]["glm_5_3_flash"]
    assert tokens["layer_split"] > tokens["replicated"] == one["capacity"]["tokens_per_rank"]["replicated"]
    assert released["layer_split"] > released["replicated"]
