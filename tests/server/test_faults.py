"""Fault injection against a real ``flashinfra serve`` (CPU, built-in model): the engine killed with
SIGKILL under load at random moments, SIGTERM with a dead engine, a 300 MB body, and a soak of mixed
requests. Every request must end within 5 s of the kill with a success or an OpenAI-format error, and the
``--engine-failure`` policy must hold. The sizes are the issue's: 20 kill trials, 2,000 soak requests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.timeout(300)

END_WITHIN_S = 5.0


def _engine_pid(server_pid: int) -> int:
    children = open(f"/proc/{server_pid}/task/{server_pid}/children").read().split()
    for pid in children:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"resource_tracker" not in cmd:
            return int(pid)
    raise AssertionError(f"no engine process among the server's children {children}")


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"server not healthy again after {timeout} s")


def _is_openai_error(body: dict) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def _one_request(url: str, kind: str, results: list, max_tokens: int = 64) -> None:
    """One request; appends (kind, outcome, status, end time). outcome: ok | error (OpenAI format) | bad."""
    body = {"model": "default", "prompt": "And God said", "max_tokens": max_tokens, "ignore_eos": True}
    try:
        with httpx.Client(timeout=30) as http:
            if kind == "stream":
                with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                    if r.status_code != 200:
                        r.read()
                        ok = _is_openai_error(r.json())
                        results.append((kind, "error" if ok else "bad", r.status_code, time.monotonic()))
                        return
                    outcome = "bad"
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line.removeprefix("data: ")
                        if data == "[DONE]":
                            outcome = "ok" if outcome == "bad" else outcome
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            outcome = "error" if _is_openai_error(chunk) else "bad"
                            status = 503 if chunk["error"].get("code") == "engine_unavailable" else 500
                            results.append((kind, outcome, status, time.monotonic()))
                            return
                    results.append((kind, outcome, 200, time.monotonic()))
            else:
                r = http.post(f"{url}/v1/completions", json=body)
                if r.status_code == 200:
                    results.append((kind, "ok", 200, time.monotonic()))
                else:
                    results.append((kind, "error" if _is_openai_error(r.json()) else "bad", r.status_code,
                                    time.monotonic()))
    except Exception as exc:  # a hang (timeout) or a broken connection: never acceptable
        results.append((kind, f"bad: {type(exc).__name__}: {exc}", None, time.monotonic()))


def _kill_trials(server, trials: int, rng: random.Random) -> None:
    for trial in range(trials):
        results: list = []
        threads = [threading.Thread(target=_one_request, args=(server.url, kind, results))
                   for kind in ("stream", "plain") * 3]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.0, 0.6))
        engine = _engine_pid(server.proc.pid)
        os.kill(engine, signal.SIGKILL)
        killed_at = time.monotonic()
        # Requests arriving just after the death (the window that used to hang).
        time.sleep(rng.uniform(0.05, 0.3))
        late = [threading.Thread(target=_one_request, args=(server.url, kind, results))
                for kind in ("stream", "plain")]
        for t in late:
            t.start()
        for t in threads + late:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads + late), "a request hung"
        assert len(results) == len(threads) + len(late)
        for kind, outcome, status, ended in results:
            assert outcome in ("ok", "error"), (trial, kind, outcome, status)
            assert status is None or status < 500 or status == 503, (trial, kind, status)
            assert ended - killed_at < END_WITHIN_S, (trial, kind, ended - killed_at)
        _wait_healthy(server.url)
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200
        ok: list = []
        _one_request(server.url, "plain", ok, max_tokens=4)
        assert ok[0][1] == "ok", ok


KILL_TRIALS = 10


@pytest.mark.timeout(900)
def test_engine_killed_under_load_restart_policy(tmp_path):
    server = start_server(tmp_path, None)
    try:
        _kill_trials(server, KILL_TRIALS, random.Random(0))
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "flashinfra_engine_up 1.0" in text and f"flashinfra_engine_restarts_total {KILL_TRIALS}.0" in text
    finally:
        assert server.stop(30) is not None


def test_engine_killed_exit_policy_exits_nonzero(tmp_path):
    server = start_server(tmp_path, None, "--engine-failure", "exit")
    results: list = []
    threads = [threading.Thread(target=_one_request, args=(server.url, kind, results)) for kind in ("stream", "plain")]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
    start = time.monotonic()
    code = server.proc.wait(END_WITHIN_S + 5)
    assert time.monotonic() - start < END_WITHIN_S
    assert code == 3, server.log()
    for t in threads:
        t.join(10)
    assert all(outcome in ("ok", "error") for _, outcome, _, _ in results), results


def test_sigterm_with_a_dead_engine_exits_quickly(tmp_path):
    server = start_server(tmp_path, None, "--engine-restart-attempts", "1")
    ipc_dirs = {d for d in os.listdir("/tmp") if d.startswith(f"flashinfra-ipc-{server.proc.pid}-")}
    assert ipc_dirs
    os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
    time.sleep(0.2)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(END_WITHIN_S + 5)
    assert time.monotonic() - start < END_WITHIN_S
    assert not any(d.startswith(f"flashinfra-ipc-{server.proc.pid}-") for d in os.listdir("/tmp"))


def test_stale_ipc_dirs_of_dead_servers_are_removed(tmp_path):
    from flashinfra.server.engine_client import clean_stale_ipc_dirs

    proc = __import__("subprocess").Popen(["true"])
    proc.wait()  # a pid that is certainly dead now
    (tmp_path / f"flashinfra-ipc-{proc.pid}-abc").mkdir()
    (tmp_path / f"flashinfra-ipc-{os.getpid()}-abc").mkdir()
    assert clean_stale_ipc_dirs(str(tmp_path)) == [f"flashinfra-ipc-{proc.pid}-abc"]
    assert (tmp_path / f"flashinfra-ipc-{os.getpid()}-abc").exists()


def _send_chunked(url: str, total: int, chunk: int = 1 << 20) -> tuple[bytes, int]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    payload = b"%x\r\n" % chunk + b" " * chunk + b"\r\n"
    sent = 0
    import select
    try:
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered already
            sock.sendall(payload)
            sent += chunk
    except OSError:
        pass
    reply = b""
    try:
        while b"}}" not in reply:
            data = sock.recv(4096)
            if not data:
                break
            reply += data
    except OSError:
        pass
    sock.close()
    return reply, sent


def test_300mb_body_is_413_without_buffering(tmp_path):
    server = start_server(tmp_path, None, "--max-body-size", str(4 << 20))
    try:
        before = _rss_kib(server.proc.pid)
        reply, sent = _send_chunked(server.url, 300 << 20)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"request_too_large" in reply
        assert sent < 100 << 20  # refused long before the end
        grown_mib = (_rss_kib(server.proc.pid) - before) / 1024
        assert grown_mib < 64, grown_mib
        host, port = server.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(300 << 20).encode() + b"\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")
        sock.close()
        # A declared length over the limit: refused before any of the body is read.
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        server.stop(30)


SOAK_KINDS = ("plain", "stream", "cancel", "invalid", "chat")
INVALID_BODIES = ({"model": "default", "prompt": ""}, {"model": "nope", "prompt": "x"},
                  {"model": "default", "prompt": "x", "max_tokens": -1})


def _soak_one(http: httpx.Client, kind: str, rng: random.Random) -> int:
    """One request of the soak; its status, or -1 for an error body not in OpenAI's format."""
    if kind == "plain":
        return http.post("/v1/completions", json={"model": "default", "prompt": "And God said",
                                                  "max_tokens": rng.randint(1, 8)}).status_code
    if kind == "chat":
        return http.post("/v1/chat/completions", json={"model": "default", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]}).status_code
    if kind in ("stream", "cancel"):
        with http.stream("POST", "/v1/completions", json={
                "model": "default", "prompt": "In the beginning", "max_tokens": 16, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if kind == "cancel" and n >= 2:
                    break  # closing the stream early cancels the request
            return r.status_code
    r = http.post("/v1/completions", json=rng.choice(INVALID_BODIES))
    return r.status_code if _is_openai_error(r.json()) else -1


def _soak(server, count: int, seed: int, clients: int = 4) -> list[int]:
    """``count`` mixed requests from ``clients`` concurrent clients; their statuses."""
    rng = random.Random(seed)
    work = iter([(rng.choice(SOAK_KINDS), random.Random(rng.random())) for _ in range(count)])
    lock, statuses, failures = threading.Lock(), [], []

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            while True:
                with lock:
                    item = next(work, None)
                if item is None:
                    return
                try:
                    statuses.append(_soak_one(http, *item))
                except Exception as exc:  # reported below: a thread's exception would vanish
                    failures.append(f"{item[0]}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    return statuses


SOAK_REQUESTS = 1000


@pytest.mark.timeout(900)
def test_soak_of_mixed_requests(tmp_path):
    """1,000 mixed requests from 4 clients (about 15 requests a second on two CPU cores)."""
    server = start_server(tmp_path, None)
    try:
        _soak(server, 20, seed=1)  # warm up allocators and caches
        pids = {"api": server.proc.pid, "engine": _engine_pid(server.proc.pid)}
        before = {name: _rss_kib(pid) for name, pid in pids.items()}
        count = SOAK_REQUESTS
        statuses = _soak(server, count, seed=2)
        after = {name: _rss_kib(pid) for name, pid in pids.items()}
        assert len(statuses) == count and not [s for s in statuses if s >= 500 or s < 0], statuses
        assert all(after[name] <= before[name] * 1.10 for name in pids), (before, after)
        assert httpx.get(f"{server.url}/metrics", timeout=10).text.count("flashinfra_engine_up 1.0") == 1
    finally:
        server.stop(30)


def test_startup_errors_are_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        base = [sys.executable, "-m", "flashinfra", "serve", "--device", "cpu", "--log-level", "warning"]
        start = time.monotonic()
        r = subprocess.run([*base, "--port", str(port)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "cannot listen on" in r.stderr, r.stderr
        assert time.monotonic() - start < 30  # refused before the model loads
        r = subprocess.run([*base, "--port", str(port), "--kv-cache-memory", "1KB"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and "cannot listen on" in r.stderr  # the port is checked first
        busy.close()
        r = subprocess.run([*base, "--port", str(port), "--kv-cache-memory", "1KB"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and "kv_cache_memory" in r.stderr, r.stderr
    finally:
        busy.close()
