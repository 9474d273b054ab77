"""Request schema validation and its translation into engine sampling parameters (no engine needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flashinfra.server.protocol import (MAX_N, ChatCompletionRequest, CompletionRequest, sub_request_seed)


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_every_sampling_field_reaches_the_engine_params():
    req = completion(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, presence_penalty=0.5,
                     frequency_penalty=-0.5, repetition_penalty=1.2, seed=7, stop_token_ids=[3, 4],
                     ignore_eos=True, logprobs=3)
    sp = req.sampling_params(max_tokens=12, num_logprobs=req.num_logprobs)
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (12, 0.7, 0.9, 5, 0.05)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (sp.seed, sp.stop_token_ids, sp.ignore_eos, sp.logprobs) == (7, (3, 4), True, 3)
    sp.validate(max_model_len=64)
    assert completion(top_k=-1).sampling_params(1, None).top_k == 0


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": 10**9}, "n"),
    ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ""}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"model": 3}, "model"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_completion_fields_name_the_field(fields, param):
    with pytest.raises(ValidationError) as info:
        completion(**fields)
    assert any(str(err["loc"][0]) == param for err in info.value.errors()), info.value.errors()


def test_non_finite_numbers_are_refused():
    for value in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValidationError):
            completion(temperature=value)


def test_unsupported_features_are_refused_not_ignored():
    with pytest.raises(ValidationError, match="logit_bias"):
        completion(logit_bias={"5": 1.0})
    with pytest.raises(ValidationError, match="suffix"):
        completion(suffix="x")
    with pytest.raises(ValidationError, match="best_of"):
        completion(best_of=3, n=2)
    with pytest.raises(ValidationError, match="stream_options"):
        completion(stream_options={"include_usage": True})
    with pytest.raises(ValidationError, match="tools"):
        chat(tools=[{"type": "function"}])
    with pytest.raises(ValidationError, match="top_logprobs requires logprobs"):
        chat(top_logprobs=2)


def test_prompt_forms():
    assert completion(prompt="x").prompts() == ["x"]
    assert completion(prompt=["x", "y"]).prompts() == ["x", "y"]
    assert completion(prompt=[5, 6]).prompts() == [[5, 6]]
    assert completion(prompt=[[5], [6, 7]]).prompts() == [[5], [6, 7]]
    assert completion(stop="x").stop_strings == ["x"]
    assert completion(stop=["x", "yz"]).stop_strings == ["x", "yz"]


def test_chat_fields():
    req = chat(messages=[{"role": "system", "content": "s"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               max_completion_tokens=9, max_tokens=3, logprobs=True, top_logprobs=4)
    assert [m.as_template_dict() for m in req.messages] == [{"role": "system", "content": "s"},
                                                             {"role": "user", "content": "ab"}]
    assert req.requested_max_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert req.num_logprobs == 4
    assert chat(logprobs=True).num_logprobs == 0
    assert chat().num_logprobs is None
    with pytest.raises(ValidationError):
        chat(messages=[])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}])


def test_sub_request_seeds_are_deterministic_and_distinct():
    assert sub_request_seed(None, 3) is None
    assert sub_request_seed(42, 0) == 42
    seeds = [sub_request_seed(42, i) for i in range(MAX_N)]
    assert seeds == [sub_request_seed(42, i) for i in range(MAX_N)]
    assert len(set(seeds)) == MAX_N and all(0 <= s < 2**63 for s in seeds)
    assert sub_request_seed(2**63 - 1, 5) < 2**63
