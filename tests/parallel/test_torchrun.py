"""Started by ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node 2``) on CPU gloo,
``flashinfra.LLM`` takes its world from the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` by ``env://``): rank 0 holds the engine, rank 1 serves its
steps inside ``LLM(...)`` and exits when rank 0's engine closes; greedy tokens equal one process's. The same
for ``flashinfra serve``: rank 0 serves HTTP, rank 1 only runs its shard."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import write_tiny_checkpoint

PROMPTS = [[11, 200, 33, 41, 5, 6, 70], [300, 2, 9]]
ENGINE = dict(device="cpu", dtype="float32", num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
SCRIPT = """
import json, sys
import flashinfra
from flashinfra import SamplingParams
llm = flashinfra.LLM(sys.argv[1], dist_timeout_s=60, **json.loads(sys.argv[3]))
outs = llm.generate(json.loads(sys.argv[4]), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
json.dump({"tp": llm.engine.config.tensor_parallel_size, "tokens": [o.token_ids for o in outs]},
          open(sys.argv[2], "w"))
llm.engine.close()
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("torchrun"), seed=4)


def test_llm_under_torchrun_equals_one_process(ckpt, tmp_path):
    script, result = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script), str(ckpt), str(result), json.dumps(ENGINE), json.dumps(PROMPTS)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(result.read_text())
    llm = flashinfra.LLM(ckpt, **ENGINE)
    want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0,
                                                                      ignore_eos=True))]
    assert got == {"tp": 2, "tokens": want}


def test_sizes_that_disagree_with_the_launcher_are_refused(ckpt, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"need max\(tp, ep\) = 2 ranks, but the launcher started WORLD_SIZE=4"):
        flashinfra.LLM(ckpt, tensor_parallel_size=2, **ENGINE)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_under_torchrun_equals_one_process(ckpt, tmp_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "flashinfra", "serve", "--model", str(ckpt), "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--num-blocks", "64", "--block-size", "4",
           "--max-num-seqs", "4", "--dist-timeout-s", "60", "--log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        got = []
        for prompt in PROMPTS:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun passes it to both ranks; rank 0's server drains and stops
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    llm = flashinfra.LLM(ckpt, **ENGINE)
    want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0,
                                                                      ignore_eos=True))]
    assert got == want
