"""``flashinfra router`` against stand-in engines (small FastAPI apps in this process, no model): the choice
of the decode engine with the fewest requests in flight, a retry on another engine when the chosen one
refuses or cannot be reached before any output, and the router's ``/metrics``.

A stand-in prefill server marks its transfer id as sent and answers; a stand-in decode server waits for its
transfer id, then streams one event per token, each released by the test (``Stub.gate``) so that requests
stay in flight as long as the test wants."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flashinfra.server.router import create_router
from tests.server.conftest import free_port

LAYOUT = {"model_fingerprint": "stub", "block_size": 4, "tensors": []}
SENT: set[str] = set()  # transfer ids the stand-in prefill servers have answered


class Stub:
    def __init__(self, role: str, refuse: bool = False, transfer_backend: str = "zmq") -> None:
        self.role, self.refuse, self.transfer_backend = role, refuse, transfer_backend
        self.gate = threading.Semaphore(0)  # one release per event a decode stub streams
        self.num_requests = 0
        self.url = ""
        self.served = None

    def app(self):
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"ok": True}

        @app.get("/disagg/info")
        async def info():
            return {"role": self.role, "transfer_address": f"tcp://{self.role}", "cache_layout": LAYOUT,
                    "model": "stub", "max_model_len": 64, "transfer_backend": self.transfer_backend}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.num_requests += 1
            if self.refuse:
                return JSONResponse({"error": {"message": "the engine is not running", "code": "engine_unavailable"}},
                                    status_code=503)
            tid = body["kv_transfer_params"]["transfer_id"]
            if self.role == "prefill":
                SENT.add(tid)
                return {"choices": [{"index": 0, "text": "a"}]}
            while tid not in SENT:
                await asyncio.sleep(0.005)

            async def events():
                for i in range(body["max_tokens"]):
                    while not self.gate.acquire(blocking=False):
                        await asyncio.sleep(0.005)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i)}], 'from': self.url})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app


class _Served:
    """An ASGI app served by uvicorn on a thread of this process (on another port if the first was taken)."""

    def __init__(self, app) -> None:
        import uvicorn

        for _ in range(3):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
            deadline = time.monotonic() + 30
            while not self.server.started and self.thread.is_alive():
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.02)
            if self.server.started:
                return
        raise AssertionError("no free port for a stand-in server")

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # the port was taken meanwhile
            pass

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def cluster():
    stubs = {"p0": Stub("prefill"), "p1": Stub("prefill"), "d0": Stub("decode"), "d1": Stub("decode")}
    served = []
    for stub in stubs.values():
        served.append(_Served(stub.app()))
        stub.url, stub.served = served[-1].url, served[-1]
    router = _Served(create_router([stubs["p0"].url, stubs["p1"].url], [stubs["d0"].url, stubs["d1"].url],
                                   connect_timeout_s=10))
    served.append(router)
    try:
        yield router.url, stubs
    finally:
        for s in served:
            s.stop()


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(flashinfra_router_\S+) (\S+)$", text, re.M)}


def _in_flight(url: str, stub: Stub) -> float:
    return _metrics(url)[f'flashinfra_router_requests_in_flight{{engine="{stub.url}",role="{stub.role}"}}']


def _stream(url: str, max_tokens: int) -> list[dict]:
    body = {"model": "stub", "prompt": "x", "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_the_decode_engine_with_the_fewest_requests_in_flight_is_chosen(cluster):
    url, stubs = cluster
    d0, d1 = stubs["d0"], stubs["d1"]
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_stream, url, 2)  # stays on d0 until the test releases its tokens
        _until(lambda: _in_flight(url, d0) == 1)
        second = pool.submit(_stream, url, 2)  # d0 is busier: d1
        _until(lambda: _in_flight(url, d1) == 1)
        for _ in range(2):
            d0.gate.release()
        assert {e["from"] for e in first.result(10)} == {d0.url}
        _until(lambda: _in_flight(url, d0) == 0)
        third = pool.submit(_stream, url, 1)  # d1 still serves the second one: d0
        _until(lambda: d0.num_requests == 2)
        d0.gate.release()
        for _ in range(2):
            d1.gate.release()
        assert {e["from"] for e in third.result(10)} == {d0.url}
        assert {e["from"] for e in second.result(10)} == {d1.url}
    m = _metrics(url)
    assert m[f'flashinfra_router_requests_total{{engine="{d0.url}",role="decode"}}'] == 2
    assert m[f'flashinfra_router_requests_total{{engine="{d1.url}",role="decode"}}'] == 1
    assert m["flashinfra_router_retries_total"] == 0


def test_a_refusing_engine_is_left_out_and_the_request_runs_elsewhere(cluster):
    url, stubs = cluster
    stubs["d0"].refuse = True
    stubs["d1"].gate.release()
    events = _stream(url, 1)
    assert [e["from"] for e in events] == [stubs["d1"].url]
    assert stubs["d0"].num_requests == 1 and stubs["d1"].num_requests == 1
    m = _metrics(url)
    assert m[f'flashinfra_router_failures_total{{engine="{stubs["d0"].url}",role="decode"}}'] == 1
    assert m["flashinfra_router_retries_total"] == 1
    assert all(v == 0 for k, v in m.items() if k.startswith("flashinfra_router_requests_in_flight"))
    # every engine of a role refusing: the client gets the last refusal
    stubs["d1"].refuse = True
    r = httpx.post(url + "/v1/completions", json={"model": "stub", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"


def test_an_unreachable_prefill_server_is_left_out(cluster):
    url, stubs = cluster
    stubs["p0"].served.stop()
    stubs["d0"].gate.release()
    assert len(_stream(url, 1)) == 1
    m = _metrics(url)
    assert m[f'flashinfra_router_failures_total{{engine="{stubs["p0"].url}",role="prefill"}}'] == 1
    assert m[f'flashinfra_router_requests_total{{engine="{stubs["p1"].url}",role="prefill"}}'] == 1
    assert m["flashinfra_router_retries_total"] == 1


def test_engines_of_different_transfer_backends_are_refused_at_start():
    from flashinfra.server.router_engines import Backend, discover

    stubs = [Stub("prefill"), Stub("decode", transfer_backend="ipc")]
    served = [_Served(stub.app()) for stub in stubs]
    try:
        backends = [Backend(s.url, stub.role) for s, stub in zip(served, stubs)]

        async def check():
            async with httpx.AsyncClient() as client:
                await discover(client, backends, timeout_s=10)

        with pytest.raises(ValueError, match=r"prefill http\S+ moves cache bytes with --transfer-backend zmq, "
                                             r"decode http\S+ with ipc"):
            asyncio.run(check())
    finally:
        for s in served:
            s.stop()
