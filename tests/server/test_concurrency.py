"""64 concurrent streamed greedy requests of mixed lengths return exactly what each returns alone, with a
roomy cache and with one so small that the engine must preempt (and /metrics counts it); then
``flashinfra bench serve`` runs against the same server and writes its JSON report."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.conftest import start_server

NUM_REQUESTS = 64


def workload() -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens): prompts of 1..48 tokens, outputs of 1..10 tokens."""
    rng = random.Random(1)
    return [([rng.randrange(7, 400) for _ in range(rng.randint(1, 48))], rng.randint(1, 10))
            for _ in range(NUM_REQUESTS)]


def request_kwargs(prompt: list[int], max_tokens: int) -> dict:
    return dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})


async def stream_all(url: str, work) -> list[tuple[str, list[int]]]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        async def one(prompt, max_tokens):
            stream = await client.completions.create(stream=True, **request_kwargs(prompt, max_tokens))
            text, ids = [], []
            async for chunk in stream:
                text.append(chunk.choices[0].text)
                ids.extend(chunk.choices[0].token_ids)
            return "".join(text), ids

        return await asyncio.gather(*(one(p, n) for p, n in work))


@pytest.fixture(scope="module")
def roomy(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("roomy"), model_dir, "--max-num-seqs", "64",
                       "--max-num-batched-tokens", "512")
    yield srv
    assert srv.stop() in (0, -15), srv.log()


@pytest.fixture(scope="module")
def alone(roomy):
    """What every request returns when it is the only one in the engine."""
    with openai.OpenAI(base_url=f"{roomy.url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        results = []
        for prompt, max_tokens in workload():
            choice = client.completions.create(**request_kwargs(prompt, max_tokens)).choices[0]
            assert len(choice.token_ids) == max_tokens
            results.append((choice.text, choice.token_ids))
    return results


def test_concurrent_streams_equal_one_at_a_time(roomy, alone):
    together = asyncio.run(stream_all(roomy.url, workload()))
    assert together == alone
    assert roomy.metric("flashinfra_num_preemptions_total") == 0
    assert roomy.metric("flashinfra_server_pending_requests") == 0


def test_concurrent_streams_equal_one_at_a_time_under_preemption(tmp_path, model_dir, alone):
    # 4-token blocks and 40 of them: the 64 requests need ~300 blocks, so admitted requests run out of
    # blocks while decoding and the engine must preempt (and later recompute) some of them.
    srv = start_server(tmp_path, model_dir, "--max-num-seqs", "64", "--block-size", "4", "--num-blocks", "40",
                       "--max-num-batched-tokens", "512")
    try:
        together = asyncio.run(stream_all(srv.url, workload()))
        preemptions = srv.metric("flashinfra_num_preemptions_total")
        metrics = httpx.get(f"{srv.url}/metrics").text
    finally:
        assert srv.stop() in (0, -15), srv.log()
    assert together == alone
    assert preemptions is not None and preemptions > 0
    assert f"flashinfra_time_to_first_token_seconds_count {NUM_REQUESTS}.0" in metrics
    assert "flashinfra_time_per_output_token_seconds_count" in metrics
    assert 'flashinfra_request_success_total{finish_reason="length"} 64.0' in metrics
    assert "flashinfra_server_event_loop_lag_seconds_count" in metrics


def test_default_model_server_drains_in_flight_requests_on_shutdown(tmp_path):
    srv = start_server(tmp_path, None)  # no --model: the built-in default model
    try:
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "default"
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=120,
                          json={"model": "default", "prompt": "Hello", "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True, "stream": True, "return_token_ids": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)  # shutdown begins while the request is in flight
            rest = [line for line in lines if line.startswith("data: ")]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        ids = [t for e in events[:-1] for t in json.loads(e[6:])["choices"][0]["token_ids"]]
        assert len(ids) == 12
        assert srv.proc.wait(60) in (0, -15)
    finally:
        srv.stop()


def test_bench_serve_writes_its_report(roomy, tmp_path, capsys):
    from flashinfra.server.bench_serve import main

    out = tmp_path / "report.json"
    argv = ["--base-url", roomy.url, "--num-prompts", "6", "--concurrency", "3", "--input-len", "12",
            "--output-len", "4", "--token-ids", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):]) == report
    assert report["completed"] == 6 and report["failed"] == 0 and report["model"] == "tiny"
    assert report["total_output_tokens"] == 24 and report["total_prompt_tokens"] == 72
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = report[key]
        assert 0 < stats["p50"] <= stats["p99"], key
    assert report["e2el_ms"]["p50"] >= report["ttft_ms"]["p50"]
    assert report["output_throughput_tok_s"] > 0


def test_bench_serve_command_line_with_request_rate_and_chat(roomy, tmp_path):
    out = tmp_path / "chat.json"
    cmd = [sys.executable, "-m", "flashinfra", "bench", "serve", "--base-url", roomy.url, "--endpoint",
           "/v1/chat/completions", "--num-prompts", "4", "--request-rate", "20", "--input-len", "6",
           "--output-len", "3", "--output", str(out), "--progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["total_output_tokens"] == 12
    assert report["config"]["request_rate"] == 20.0
    assert "bench serve" in done.stderr  # the progress bar, asked for: stderr is a pipe here
    assert httpx.get(f"{roomy.url}/health").status_code == 200
