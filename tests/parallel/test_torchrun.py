"""Started by ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node 2``) on CPU gloo,
``flashinfra.LLM`` takes its world from the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` by ``env://``): rank 0 holds the engine, rank 1 serves its
steps inside ``LLM(...)`` and exits when rank 0's engine closes; greedy tokens equal one process's."""

from __future__ import annotations

import json
import subprocess
import sys

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
    return write_tiny_checkpoint(tmp_path_factory.mktemp("torchrun"), seed=4, tokenizer=False)


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
