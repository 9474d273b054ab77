"""Disaggregated serving end to end on the loopback, with the built-in model: a prefill-role server, a
decode-role server and ``flashinfra router`` in front of them, against one ``--role both`` server.

Every test runs over each transport (ZeroMQ; Mooncake over TCP where its engine loads; shared memory). Greedy outputs
through the router equal the single server's (completions and chat, streamed and not, four
requests at a time); 64 streams at once all finish; the prefill side holds no blocks once the decode side
acknowledged; a router given a server of the wrong role refuses to start; killing the decode server mid-stream
ends the stream with an OpenAI error within 5 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import ServerProcess, free_port

ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-blocks", "256", "--max-num-seqs", "4",
          "--prefix-cache-slots", "0", "--log-level", "warning"]


def _spawn(tmp_path, name: str, *args: str) -> ServerProcess:
    port = free_port()
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flashinfra", *args, "--host", "127.0.0.1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    return ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)


def _wait_ready(servers: list[ServerProcess], timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    for s in servers:
        while True:
            assert s.proc.poll() is None, f"{s.url} exited:\n{s.log()}"
            try:
                if httpx.get(f"{s.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{s.url} not ready:\n{s.log()}"
            time.sleep(0.2)


def _kill(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server and its engine process
        server.proc.wait(10)


def _mooncake_loads() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module", params=["zmq", pytest.param("mooncake", marks=pytest.mark.skipif(
    not _mooncake_loads(), reason="the Mooncake transfer engine does not load here")), "ipc"])
def cluster(request, tmp_path_factory):
    """The servers, their request states moved by the ZeroMQ transport, by Mooncake (TCP on the loopback) or
    through the prefill server's cache in shared memory."""
    tmp = tmp_path_factory.mktemp(f"disagg-{request.param}")
    roles = ("--transfer-timeout-s", "60", "--transfer-backend", request.param)
    prefill = _spawn(tmp, "prefill", "serve", *ENGINE, "--role", "prefill", *roles)
    decode = _spawn(tmp, "decode", "serve", *ENGINE, "--role", "decode", *roles, "--log-level", "info")
    both = _spawn(tmp, "both", "serve", *ENGINE)
    router = _spawn(tmp, "router", "router", "--prefill", prefill.url, "--decode", decode.url, "--log-level", "warning")
    servers = {"prefill": prefill, "decode": decode, "both": both, "router": router}
    try:
        _wait_ready(list(servers.values()))
        yield servers
    finally:
        for s in servers.values():
            _kill(s)


def _text(url: str, path: str, body: dict) -> str:
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice.get("text") if "text" in choice else choice["message"]["content"]
    out = []
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                c = chunk["choices"][0]
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_router_outputs_equal_a_single_server(cluster, stream):
    comp = {"model": "default", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    chat = {"model": "default", "messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        want = _text(cluster["both"].url, path, body)
        assert want
        with ThreadPoolExecutor(4) as pool:  # concurrent requests share the engines' batches
            got = list(pool.map(lambda _: _text(cluster["router"].url, path, body), range(4)))
        assert got == [want] * 4


def test_the_decode_server_says_what_runs(cluster):
    """The start-up block names the model, device, dtype, context, cache (with a request's state bytes), role and
    how states move."""
    decode = cluster["decode"]
    log, backend = decode.log(), decode.proc.args[decode.proc.args.index("--transfer-backend") + 1]
    for line in ("model: default (", "device: cpu, dtype: float32", "context length: ", "cache: 256 blocks of ",
                 " of state per request",
                 f"role: decode; request states move by --transfer-backend {backend}, received at tcp://127.0.0.1:",
                 "listening on http://127.0.0.1:"):
        assert line in log, f"{line!r} not in the start-up log:\n{log}"


def test_prefill_blocks_are_freed_after_the_ack(cluster):
    prefill = cluster["prefill"]
    assert prefill.metric("flashinfra_transfers_total") >= 16
    deadline = time.monotonic() + 5
    while prefill.metric("flashinfra_transfers_held") != 0 or prefill.metric("flashinfra_cache_usage_ratio") != 0:
        assert time.monotonic() < deadline, "the prefill engine still holds blocks"
        time.sleep(0.2)
    assert prefill.metric("flashinfra_transfer_failures_total") == 0


@pytest.mark.slow
def test_64_concurrent_streams(cluster):
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True}
    want = _text(cluster["both"].url, "/v1/completions", body)
    prompts = [f"{i} apples and" for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(lambda p: _text(cluster["router"].url, "/v1/completions", {**body, "prompt": p}), prompts))
    assert all(got)
    assert _text(cluster["router"].url, "/v1/completions", body) == want
    metrics = httpx.get(cluster["router"].url + "/metrics", timeout=10).text
    in_flight = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("flashinfra_router_requests_in_flight{")]
    assert len(in_flight) == 2 and not any(in_flight)
    assert 'flashinfra_router_failures_total{engine="' in metrics and "flashinfra_router_retries_total 0.0" in metrics


def test_router_refuses_a_server_of_the_wrong_role(cluster):
    r = subprocess.run([sys.executable, "-m", "flashinfra", "router", "--prefill", cluster["prefill"].url,
                        "--decode", cluster["both"].url, "--port", str(free_port()), "--connect-timeout", "10",
                        "--log-level", "critical"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"{cluster['both'].url} is a 'both' server, given as --decode" in r.stderr


def test_decode_server_killed_mid_stream_fails_the_request_quickly(cluster):
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events, killed_at = [], None
    with httpx.stream("POST", cluster["router"].url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if killed_at is None and len(events) >= 2:
                _kill(cluster["decode"])
                killed_at = time.monotonic()
    assert killed_at is not None and time.monotonic() - killed_at < 5
    error = events[-1]["error"]
    assert error["code"] == "decode_unavailable" and "failed mid-stream" in error["message"]
    # the router answers a new request with an OpenAI error, not a hang
    r = httpx.post(cluster["router"].url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "decode_unavailable"
