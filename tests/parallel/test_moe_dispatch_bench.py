"""``bench/parallel_moe_dispatch.py --cpu`` runs over 2 gloo ranks and writes its table with every scheme
timed and a choice per token count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "parallel_moe_dispatch.py"


def test_bench_smoke_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH), "--cpu", "--world", "2", "--iters", "2", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "parallel_moe_dispatch_w2_cpu.json").read_text())
    assert out["world"] == 2 and out["backend"] == "gloo" and out["command"] and out["date"]
    for row in out["tokens"].values():
        assert all(row[k] > 0 for k in ("all_to_all", "allgather_reducescatter", "all_reduce"))
        assert row["choice"] in ("all_to_all", "allgather_reducescatter")
