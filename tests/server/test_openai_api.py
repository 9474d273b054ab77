"""The official ``openai`` client (sync, async, streaming) against a real server process with an API key:
completions and chat, every sampling parameter, stop strings and stop token ids, n > 1, logprobs."""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from tests.server.conftest import start_server

KEY = "test-key-123"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    srv = start_server(tmp_path_factory.mktemp("openai"), model_dir, "--max-num-seqs", "16", api_key=KEY)
    yield srv
    assert srv.stop() in (0, -15), srv.log()  # uvicorn re-raises the SIGTERM it handled


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def greedy(client, prompt=PROMPT, **kw):
    kw = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}
    return client.completions.create(model="tiny", prompt=prompt, **_extra(kw))


def _extra(kw: dict) -> dict:
    """Non-OpenAI fields go through ``extra_body``, as users of the official client send them."""
    extras = {k: kw.pop(k) for k in list(kw) if k in ("top_k", "min_p", "repetition_penalty", "ignore_eos",
                                                         "stop_token_ids", "return_token_ids",
                                                         "include_stop_str_in_output")}
    return {**kw, "extra_body": extras} if extras else kw


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_greedy_completion_is_deterministic_and_counts_usage(client):
    a = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    b = greedy(client, max_tokens=6)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6 and len(a.choices[0].token_ids) == 6
    assert a.usage.prompt_tokens == 5 and a.usage.total_tokens == 11
    assert a.object == "text_completion" and a.id.startswith("cmpl-")


def test_streaming_completion_matches_non_streaming_and_reports_usage(client):
    full = greedy(client, max_tokens=8)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].text for c in chunks[:-1])
    ids = [t for c in chunks[:-1] for t in c.choices[0].token_ids]
    assert text == full.choices[0].text and ids == full.choices[0].token_ids
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_sync_and_streaming_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    # The chat template was applied: the same text as a raw completion of the rendered prompt.
    rendered = "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHello!<|assistant|>\n"
    raw = greedy(client, prompt=rendered, max_tokens=6)
    assert raw.choices[0].text == full.choices[0].message.content


def test_async_client_concurrent_completions_and_chat(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as c:
            completions = [c.completions.create(model="tiny", prompt=f"Number {i}", max_tokens=4, temperature=0,
                                                extra_body={"ignore_eos": True}) for i in range(4)]
            chats = [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Hi {i}"}],
                                               max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
                     for i in range(4)]
            stream = await c.completions.create(model="tiny", prompt="Number 0", max_tokens=4, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
            streamed = "".join([chunk.choices[0].text async for chunk in stream])
            return await asyncio.gather(*completions, *chats), streamed

    results, streamed = asyncio.run(main())
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert results[0].choices[0].text == streamed


def test_truncating_samplers_reduce_to_greedy(client):
    """top_k=1, min_p=1 and a tiny top_p each leave only the most likely token: exactly greedy."""
    want = greedy(client, max_tokens=4).choices[0].token_ids
    for kw in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-9}):
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3,
                                        **_extra({"ignore_eos": True, "return_token_ids": True, **kw}))
        assert got.choices[0].token_ids == want, kw


def test_seeded_sampling_and_n(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": 50, "min_p": 0.01})
    one = client.completions.create(seed=1234, **kw)
    again = client.completions.create(seed=1234, **kw)
    assert one.choices[0].token_ids == again.choices[0].token_ids
    many = client.completions.create(seed=1234, n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].token_ids == one.choices[0].token_ids  # choice 0 keeps the request's seed
    assert len({tuple(c.token_ids) for c in many.choices}) > 1  # the others get their own seeds
    assert many.usage.completion_tokens == 18 and many.usage.prompt_tokens == 5


def test_penalties_are_applied(client):
    """Negative presence/frequency penalties reward tokens already generated, so the tiny model's greedy
    output starts repeating; a repetition penalty below 1 favours prompt tokens. Fixed weights, prompt and
    greedy decoding make this deterministic; the penalty arithmetic itself is checked in tests/runner."""
    base = greedy(client, max_tokens=8).choices[0].token_ids
    assert len(set(base)) == 8  # no repeats: positive output penalties would change nothing here
    for kw in ({"presence_penalty": -2.0}, {"frequency_penalty": -2.0}, {"repetition_penalty": 0.5}):
        out = greedy(client, max_tokens=8, **kw).choices[0].token_ids
        assert len(out) == 8 and out != base, kw
        if "repetition_penalty" not in kw:
            assert out[0] == base[0], kw  # output penalties cannot change the first token
            assert len(set(out)) < 8, kw
    assert greedy(client, max_tokens=8, presence_penalty=2.0, frequency_penalty=2.0,
                  repetition_penalty=1.2).choices[0].finish_reason == "length"


def test_stop_strings_and_stop_token_ids(client):
    full = greedy(client, max_tokens=10).choices[0]
    text, ids = full.text, full.token_ids
    # A 3-character stop string whose first occurrence starts at ``at`` > 0.
    at = next(i for i in range(1, len(text) - 3) if text.find(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (got, reason) == (text[:at], "stop"), stream
    kept = greedy(client, max_tokens=10, stop=stop, include_stop_str_in_output=True).choices[0]
    assert kept.text == text[:at + 3] and kept.finish_reason == "stop"
    cut = greedy(client, max_tokens=10, stop_token_ids=[ids[4]]).choices[0]
    assert cut.finish_reason == "stop" and cut.token_ids == ids[:ids.index(ids[4]) + 1]


def test_ignore_eos_runs_to_max_tokens(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=9, n=2,
                                    extra_body={"ignore_eos": True})
    assert all(c.finish_reason == "length" for c in out.choices) and out.usage.completion_tokens == 24


def test_completion_logprobs(client):
    out = greedy(client, max_tokens=5, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0 and math.isfinite(logprob)
        # Up to 3 + the sampled token; fewer when distinct ids decode to the same text (partial bytes).
        assert 1 <= len(top) <= 4 and top[token] == logprob
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-5)  # greedy picks the most likely
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    zero = greedy(client, max_tokens=3, logprobs=0).choices[0].logprobs
    assert len(zero.token_logprobs) == 3 and all(len(t) == 1 for t in zero.top_logprobs)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_batched_prompts_and_echo(client):
    out = client.completions.create(model="tiny", prompt=["Hello", "Good bye"], max_tokens=3, temperature=0,
                                    n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples of a prompt agree
    assert out.choices[0].text == greedy(client, prompt="Hello", max_tokens=3).choices[0].text
    assert out.choices[2].text == greedy(client, prompt="Good bye", max_tokens=3).choices[0].text
    assert out.usage.completion_tokens == 12
    ids = client.completions.create(model="tiny", prompt=[[40, 41, 42], [43]], max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 4
    echo = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "Hello" + out.choices[0].text
