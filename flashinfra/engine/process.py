"""The engine process: an ``EngineCore`` driven by msgspec messages over two ZeroMQ sockets.

The server binds two addresses (e.g. ``ipc://`` paths in a temp dir) and starts this process with
``start_engine_process(config, input_address, output_address)``; the engine connects a PULL socket to
``input_address`` (``EngineRequest`` / ``EngineRequests`` / ``AbortRequest`` / ``Shutdown`` from the
server) and a PUSH socket to ``output_address`` (``EngineReady`` once loaded, or ``EngineError`` if loading failed; then
``EngineOutputs`` after every step; ``EngineError`` if the loop itself fails). Messages are msgpack, never pickle; the
config travels as msgpack too.

Loop: take every message already waiting (never blocking while there is work), step once, send the step's
outputs with stats. When idle it blocks on the input socket for a short while (and on what disaggregated
serving wakes it by: ``disagg.wake.LoopPoller``) and sends stats about once a second. An invalid request is
answered by an ``error`` output for it alone. The process ignores SIGINT (the server shuts it down with
``Shutdown`` after draining) and exits if its parent dies.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback

import msgspec

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.sched.messages import (
    AbortRequest,
    EngineError,
    EngineOutputs,
    EngineRequests,
    RequestOutput,
    Shutdown,
    decode_server_message,
    encode,
)

IDLE_POLL_MS = 50
IDLE_STATS_S = 1.0


def start_engine_process(config: EngineConfig, input_address: str, output_address: str) -> multiprocessing.Process:
    """Start the engine in a fresh (spawned) process; the caller binds both addresses."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=run_engine,
        args=(msgspec.msgpack.encode(config), input_address, output_address),
        name="flashinfra-engine",
        daemon=True,
    )
    proc.start()
    return proc


def run_engine(config: bytes | EngineConfig, input_address: str, output_address: str) -> None:
    """Process entry point: load, announce, serve until ``Shutdown`` or the parent's death."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if isinstance(config, bytes):
        config = msgspec.msgpack.decode(config, type=EngineConfig)
    parent = os.getppid()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_address)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(output_address)
    try:
        from flashinfra.parallel.engine import make_engine

        try:
            core = make_engine(config)
        except Exception as e:
            out.send(encode(EngineError(f"engine failed to start: {type(e).__name__}: {e}\n{traceback.format_exc()}")))
            return
        out.send(encode(core.ready_message()))
        try:
            _serve(core, inp, out, parent)
        except Exception as e:  # a bug in the loop itself: tell the server before dying
            out.send(encode(EngineError(f"engine loop failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")))
            raise
        finally:
            core.close()
    finally:
        inp.close(linger=0)
        out.close()
        ctx.term()


def _serve(core, inp, out, parent: int) -> None:
    from flashinfra.disagg.wake import LoopPoller

    last_sent = time.monotonic()
    poller = LoopPoller(core, inp)  # a cache transfer that needs the loop wakes it too
    while True:
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        rejected: list[RequestOutput] = []
        while inp in poller.poll(timeout):
            timeout = 0
            try:
                msg = decode_server_message(inp.recv())
            except msgspec.DecodeError:
                continue  # nothing in it can be attributed to a request
            if isinstance(msg, Shutdown):
                core.abort([r for r in list(core.scheduler.requests)])
                out.send(encode(EngineOutputs(core.step(), core.stats())))
                return
            if isinstance(msg, AbortRequest):
                core.abort(msg.request_ids)
            else:
                for request in msg.with_media() if isinstance(msg, EngineRequests) else [msg]:
                    try:
                        core.add_request(request)
                    except ValueError as e:
                        rejected.append(RequestOutput(request.request_id, [], None, True, "error", error=str(e),
                                                      num_prompt_tokens=len(request.prompt_token_ids)))
        stepped = core.has_work()
        outputs = rejected + (core.step() if stepped else [])
        now = time.monotonic()
        if stepped or outputs or now - last_sent >= IDLE_STATS_S:
            out.send(encode(EngineOutputs(outputs, core.stats())))
            last_sent = now
        if getattr(core, "fatal_error", None):  # a lost tensor-parallel rank: every later step would fail too
            out.send(encode(EngineError(core.fatal_error)))
            return
        if not core.has_work() and os.getppid() != parent:
            return
