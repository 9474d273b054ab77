"""``bench/parallel_check.py --smoke`` under torchrun (2 CPU ranks over gloo, TP=2 x EP=2, the tiny model in float32,
both servers) passes its checks and writes its JSON: every layer within float32 rounding of the one-rank reference,
the same logits argmax, the served greedy tokens the reference's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "parallel_check.py"


def test_parallel_check_smoke_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # the ranks import this tree
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(BENCH),
           "--smoke", "--tp", "2", "--ep", "2", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun stops its ranks, and they their servers
        out, _ = proc.communicate(timeout=150)
        raise AssertionError(f"timed out:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    r = json.loads((tmp_path / "parallel_check_smoke_tp2_ep2.json").read_text())
    assert r["device"] and r["command"] and r["date"]
    assert r["ok"] and r["failed"] == [] and (r["tp"], r["ep"], r["dtype"]) == (2, 2, "float32")
    assert len(r["layers"]) == 2 * 6 and {x["kind"] for x in r["layers"]} >= {"kda+dense", "kda+moe", "mla+moe"}
    for x in r["layers"]:
        assert x["ok"] and x["err_sh_ref"] < 1e-5 and x["err_sh_hi"] < 1e-5, x
        assert x.get("flips_sh_ref", 0.0) == 0.0 and x["excluded"] == 0, x
    for step in ("prefill", "decode"):
        assert r[f"embed_{step}_max_abs_err"] == 0.0
        assert r[f"head_{step}"]["argmax_agree"] == 1.0 and r[f"head_{step}"]["err_sh_ref"] < 1e-5
        assert r[f"chained_{step}"]["argmax_agree"] == 1.0 and r[f"chained_{step}"]["err_sh_ref"] < 1e-4
    server = r["server"]
    assert server["ok"] and server["tokens"] == 2 * 4 and server["argmax"] + server["tie"] == 8
    assert server["one_rank_equal"] == 8 and r["served"]["sharded"] == r["served"]["one_rank"]
