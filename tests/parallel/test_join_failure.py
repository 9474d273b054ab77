"""A rank lost while the world forms fails rank 0 within seconds (not after ``dist_timeout_s``), whether
it dies right after joining the default group (rank 0 would otherwise wait in the next group's creation)
or at any moment of ``LLM(tensor_parallel_size=2)``'s start; the control channel bounds every message,
and rank 0's keepalive holds idle workers past that bound."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.multiprocessing as mp

from flashinfra.model.factory import write_tiny_checkpoint

RANK0 = """
import sys
from flashinfra.engine.config import EngineConfig
from flashinfra.parallel.engine import join_world
from flashinfra.parallel.launch import Launch, RankLost, start_workers, watched
import subprocess
init, model = sys.argv[1], sys.argv[2]
worker = subprocess.Popen([sys.executable, "-c", sys.argv[3], init])
config = EngineConfig(model=model, tensor_parallel_size=2, device="cpu", dtype="float32", dist_timeout_s=120)
try:
    watched(lambda: join_world(config, Launch(0, 2, "cpu", init, ())), {1: worker}, "world lost")
except RankLost as e:
    print(e, flush=True)
    sys.exit(3)
"""
DIES_AFTER_DEFAULT_GROUP = """
import os, sys
from flashinfra.parallel.groups import init_distributed
init_distributed(1, 2, "cpu", sys.argv[1], timeout_s=120)
os._exit(7)
"""
LLM_RANK0 = """
import sys
import flashinfra
flashinfra.LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", num_blocks=32,
               max_num_seqs=2, dist_timeout_s=120)
"""
BOUND_S = 15  # far under dist_timeout_s (120): only watching the process can be this fast


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("join"), tokenizer=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_dying_after_default_group_fails_rank0_at_once(ckpt):
    init = f"tcp://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-c", RANK0, init, str(ckpt), DIES_AFTER_DEFAULT_GROUP],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "rank 1" in r.stdout and "exited with code 7" in r.stdout, r.stdout
    assert time.monotonic() - start < BOUND_S + 30  # two interpreters' start-up included


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
            if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_rank_killed_while_llm_starts_fails_it_at_once(ckpt):
    proc = subprocess.Popen([sys.executable, "-c", LLM_RANK0, str(ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (workers := _children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=BOUND_S + 10)
        assert time.monotonic() - killed < BOUND_S, err[-2000:]
        assert proc.returncode != 0
        assert "RankLost" in err and "rank 1" in err and "exited with code -9" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _channel_rank(rank: int, port: int, out: dict) -> None:
    import time

    from flashinfra.parallel.groups import control_channel, init_distributed

    init_distributed(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=30)
    channel = control_channel(timeout_s=2)
    if rank == 0:
        channel.start_keepalive(0.5, lambda e: out.setdefault("keepalive_error", str(e)))
        time.sleep(4)  # twice the timeout, idle: only the keepalives hold the worker
        channel.send(b"plan")
        channel.done()
        channel.stop_keepalive()
        time.sleep(6)  # silent past the timeout: the worker gives up
        return
    out["first"] = channel.recv()
    start = time.monotonic()
    try:
        channel.recv()
    except RuntimeError as e:
        out["silent"] = (time.monotonic() - start, str(e).splitlines()[0])


def test_control_channel_is_bounded_and_kept_alive():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_channel_rank, args=(_free_port(), out), nprocs=2, join=True, start_method="fork")
        out = dict(out)
    assert out["first"] == b"plan" and "keepalive_error" not in out
    waited, message = out["silent"]
    assert 1.5 < waited < 5, (waited, message)
