"""Bad input and faults against a real server: every bad request is a 400 in OpenAI's error format (never a
5xx), a full queue is a 429, a client that goes away frees its request in the engine at once, and
property-based fuzzing of both request schemas finds no 5xx and leaves the server answering correctly."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import start_server

MAX_PENDING = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("errors"), model_dir, "--max-pending", str(MAX_PENDING),
                       "--max-model-len", "256")
    yield srv
    assert srv.stop() in (0, -15), srv.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http):
    """A greedy completion taken before any bad input reached the server."""
    return _greedy(http)


def _greedy(http) -> str:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 4,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_COMPLETIONS = [
    ({"prompt": "x"}, "model"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": []}, "prompt"),
    ({"model": "tiny", "prompt": [100000]}, "prompt"),
    ({"model": "tiny", "prompt": "word " * 400}, "prompt"),
    ({"model": "tiny", "prompt": "word " * 1000}, "prompt"),  # long enough for the tokenizer thread pool
    ({"model": "tiny", "prompt": "x" * 5_000_000}, "prompt"),  # refused before tokenizing
    ({"model": "tiny", "prompt": "x", "max_tokens": 1000}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": "x", "temperature": "warm"}, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_k": 1.5}, "top_k"),
    ({"model": "tiny", "prompt": "x", "min_p": -0.1}, "min_p"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ({"model": "tiny", "prompt": "x", "seed": -5}, "seed"),
    ({"model": "tiny", "prompt": "x", "n": 1000000}, "n"),
    ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 50}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": 5}, "stop"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "stream": "true"}, "stream"),
]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}),
])
def test_unknown_model_is_404(http, reference, route, body):
    error = assert_openai_error(http.post(route, json=body), 404, "model")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_requests_are_400(http, reference, body, param):
    assert_openai_error(http.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hi"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user"}], "max_tokens": 300}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "pirate", "content": "arr"}]}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 4}, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, None),
])
def test_bad_chat_requests_are_400(http, reference, body, param):
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("raw, content_type", [
    (b"{not json", "application/json"),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', "application/json"),
    (b"\xff\xfe\x00garbage", "application/json"),
    (b"", "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b'"just a string"', "application/json"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "application/json"),
    (b'{"model": "tiny", "prompt": "x"}', "text/plain"),
])
def test_malformed_bodies_are_400(http, reference, raw, content_type):
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert_openai_error(http.post(path, content=raw, headers={"content-type": content_type}), 400)


def test_lone_surrogates_are_400(http, reference):
    """Valid JSON escapes that are not valid Unicode text (a lone surrogate)."""
    raw = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'
    assert_openai_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                        400, "prompt")
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    assert_openai_error(http.post("/v1/chat/completions", content=raw,
                                  headers={"content-type": "application/json"}), 400, "messages")


def test_openapi_schema_documents_both_request_bodies(http):
    schema = http.get("/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(model)
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "n", "temperature", "top_k", "stop", "stream_options", "logprobs"} <= set(fields)


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def _open_stream(server, max_tokens: int) -> socket.socket:
    """A raw streaming request whose socket the test closes itself (a client that goes away)."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_full_queue_is_429_and_disconnect_frees_the_engine_at_once(server, http, reference):
    socks = [_open_stream(server, 200) for _ in range(MAX_PENDING)]
    try:
        for sock in socks:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # each one is streaming
        assert _wait_for(lambda: server.metric("flashinfra_num_requests_running") == MAX_PENDING)
        assert server.metric("flashinfra_cache_usage_ratio") > 0
        response = http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        error = assert_openai_error(response, 429)
        assert error["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
        # More sub-requests than the server ever holds can never fit: 400, not 429.
        assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": ["x"] * MAX_PENDING,
                                                               "n": 2}), 400, "n")
    finally:
        for sock in socks:
            sock.close()
    start = time.monotonic()
    # Each request still had ~200 tokens to go; freed in well under the time one of them needs.
    assert _wait_for(lambda: server.metric("flashinfra_server_pending_requests") == 0
                     and server.metric("flashinfra_num_requests_running") == 0
                     and server.metric("flashinfra_cache_usage_ratio") == 0.0, timeout=30)
    assert time.monotonic() - start < 30
    assert _greedy(http) == reference


def test_disconnect_of_a_non_streaming_request_aborts_it(server, reference):
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 200, "temperature": 0,
                       "ignore_eos": True, "n": 2}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert _wait_for(lambda: server.metric("flashinfra_num_requests_running") == 2)
    sock.close()
    assert _wait_for(lambda: server.metric("flashinfra_server_pending_requests") == 0
                     and server.metric("flashinfra_num_requests_running") == 0, timeout=30)


# Any code point, lone surrogates and NUL included (valid JSON escapes, invalid text).
any_text = st.text(st.characters(exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00"]),
                   max_size=20)
json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | any_text)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


VALID_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 3),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "logprobs": st.integers(0, 5),
}
VALID_PROMPTS = st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 400), min_size=1, max_size=6)
VALID_MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}), min_size=1,
    max_size=3)


def _request(key: str, valid_input, chat: bool):
    """Valid requests, valid requests with one field replaced by any JSON value, and anything at all.
    ``max_tokens`` of a valid request is at most 3, so each costs at most a few engine steps."""
    sampling = dict(VALID_SAMPLING)
    if chat:
        sampling["logprobs"] = st.booleans()
    valid = st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.integers(1, 3), key: valid_input},
                                  optional=sampling)
    fields = ["model", "max_tokens", key, *sampling, "stream_options", "logit_bias", "top_logprobs"]

    def replace(request: dict, field: str, value) -> dict:
        return {**request, field: value}

    one_bad = st.builds(replace, valid, st.sampled_from(fields), json_values)
    wild = st.dictionaries(st.sampled_from(fields), json_values, max_size=8)
    return st.one_of(valid, valid, one_bad, wild)


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            for event in events[:-1]:
                assert "error" not in json.loads(event[6:]), event
        else:
            assert response.json()["choices"]
    else:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(completion=_request("prompt", VALID_PROMPTS, chat=False), chat=_request("messages", VALID_MESSAGES, chat=True))
def test_fuzzed_requests_never_get_a_5xx(http, completion, chat):
    headers = {"content-type": "application/json"}
    # ensure_ascii escapes lone surrogates, so every body is valid JSON whatever the strings hold.
    _check_answer(http.post("/v1/completions", content=json.dumps(completion).encode(), headers=headers))
    _check_answer(http.post("/v1/chat/completions", content=json.dumps(chat).encode(), headers=headers))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=st.binary(max_size=200) | any_text.map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_fuzzed_raw_bodies_never_get_a_5xx(http, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        _check_answer(http.post(path, content=body, headers={"content-type": "application/json"}))


def test_server_still_answers_correctly_after_fuzzing(server, http, reference):
    assert http.get("/health").status_code == 200
    assert _greedy(http) == reference
    assert server.metric("flashinfra_server_pending_requests") == 0


def test_engine_death_fails_requests_cleanly_and_health_says_so(server, http):
    """Last in this module: it kills the engine process under the server."""
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    engines = [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(engines) == 1, children
    sock = _open_stream(server, 200)
    try:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        os.kill(engines[0], signal.SIGKILL)
        received = b""
        while b"data: [DONE]" not in received and b'"error"' not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        assert b'"error"' in received and b"engine" in received  # the stream ends with an error event
    finally:
        sock.close()
    assert _wait_for(lambda: http.get("/health").status_code == 503, timeout=10)
    error = assert_openai_error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                                   "max_tokens": 2}), 503)
    assert "engine" in error["message"]
