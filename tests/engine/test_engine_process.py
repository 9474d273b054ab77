"""The engine process over real ZeroMQ sockets: ready message, requests, invalid input, abort, stats, shutdown."""

from __future__ import annotations

import time

import pytest
import zmq

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.process import start_engine_process
from flashinfra.engine.sched.messages import (
    AbortRequest,
    EngineError,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    SamplingParams,
    Shutdown,
    decode_engine_message,
    encode,
)
from flashinfra.model.factory import write_tiny_checkpoint


class Client:
    def __init__(self, tmp_path, config: EngineConfig):
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.pull = self.ctx.socket(zmq.PULL)
        inp, out = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
        self.push.bind(inp)
        self.pull.bind(out)
        self.proc = start_engine_process(config, inp, out)
        self.tokens: dict[str, list[int]] = {}
        self.done: dict[str, object] = {}

    def send(self, msg) -> None:
        self.push.send(encode(msg))

    def recv(self, timeout_s: float = 60.0):
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the engine")
        return decode_engine_message(self.pull.recv())

    def collect(self, ids: set[str], timeout_s: float = 120.0):
        """Read outputs until every request in ``ids`` has finished: the tokens and final output of every
        request seen so far (outputs of other requests are kept for later calls), and the last stats."""
        stats = None
        deadline = time.monotonic() + timeout_s
        while not ids <= set(self.done):
            msg = self.recv(max(0.1, deadline - time.monotonic()))
            assert isinstance(msg, EngineOutputs)
            stats = msg.stats or stats
            for o in msg.outputs:
                assert o.request_id not in self.done, "output after the request finished"
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.done[o.request_id] = o
        return self.tokens, self.done, stats

    def close(self) -> None:
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def req(rid: str, prompt: list[int], **kw) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(**kw), time.time())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_process_round_trip(tmp_path, ckpt, async_scheduling):
    c = Client(tmp_path, EngineConfig(model=str(ckpt), num_blocks=64, block_size=4, max_num_seqs=4,
                                      async_scheduling=async_scheduling))
    try:
        ready = c.recv(120)
        assert isinstance(ready, EngineReady)
        assert ready.vocab_size == 512 and ready.num_blocks == 64 and ready.max_model_len == 256
        assert ready.eos_token_ids == [0, 4]
        c.send(req("a", [5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2))
        c.send(req("b", [9, 10], max_tokens=200, temperature=0.0, ignore_eos=True))
        c.send(req("bad", [1, 2, 9999], max_tokens=3))
        c.send(req("long", [3] * 300, max_tokens=3))
        got, done, _ = c.collect({"a", "bad", "long"})
        assert done["a"].finish_reason == "length" and len(got["a"]) == 3
        assert done["bad"].finish_reason == "error" and "token ids" in done["bad"].error
        assert done["long"].finish_reason == "error" and "limit" in done["long"].error
        c.send(AbortRequest(["b", "unknown"]))
        got, done, stats = c.collect({"b"})
        assert done["b"].finish_reason == "abort" and 0 < len(got["b"]) < 200
        assert stats.num_running == 0 and stats.num_blocks_free == 64
        # the same request again gives the same greedy tokens
        c.send(req("a2", [5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True))
        got, _, _ = c.collect({"a2"})
        assert got["a2"] == got["a"]
        c.send(Shutdown())
        c.proc.join(timeout=30)
        assert c.proc.exitcode == 0
    finally:
        c.close()


def test_engine_process_reports_a_failed_start(tmp_path):
    c = Client(tmp_path, EngineConfig(model=str(tmp_path / "missing"), device="cpu"))
    try:
        msg = c.recv(120)
        assert isinstance(msg, EngineError) and "engine failed to start" in msg.message
        c.proc.join(timeout=30)
        assert c.proc.exitcode == 0
    finally:
        c.close()
