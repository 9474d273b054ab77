"""The official ``openai`` client against a real server running the built-in model with a chat template in
GLM-4.7's format: the tool-calling round trip (``tool_choice`` required and named, enforced by the grammar),
streamed tool-call deltas, JSON-schema outputs that validate, and the 400s of bad tool/schema/template input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import start_server

TEMPLATE = Path(__file__).parent / "data" / "glm_chat_template.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from flashinfra.model.factory import default_model_dir

    model = tmp_path_factory.mktemp("glm-template") / "model"
    shutil.copytree(default_model_dir(), model)
    shutil.copy(TEMPLATE, model / "chat_template.jinja")  # preferred over tokenizer_config's template
    srv = start_server(tmp_path_factory.mktemp("tools"), model, "--max-num-seqs", "8")
    yield srv
    assert srv.stop() in (0, -15), srv.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


def chat(client, **kw):
    kw = {"model": "tiny", "messages": USER, "temperature": 0, "max_tokens": 240, **kw}
    return client.chat.completions.create(**kw)


def test_required_tool_call_round_trip(client):
    first = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=NO_THINKING)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "now")
    arguments = json.loads(call.function.arguments)
    schema = WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(arguments, schema)
    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = chat(client, messages=history, tools=TOOLS, tool_choice="auto", max_tokens=12, extra_body=NO_THINKING)
    assert second.choices[0].message.role == "assistant"
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_named_tool_streams_the_same_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, extra_body=NO_THINKING)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    names, arguments, finish = [], "", None
    for chunk in chat(client, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, stream=True,
                      extra_body=NO_THINKING):
        delta = chunk.choices[0].delta
        for entry in delta.tool_calls or []:
            assert entry.index == 0
            if entry.function.name:
                assert not arguments, "the name comes first"
                names.append(entry.function.name)
            arguments += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads(arguments) == json.loads(call.function.arguments)


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["answer", "score"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    r = chat(client, response_format=fmt, extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # thinking: the model reasons first, and the schema holds for the answer after </think> (the built-in
    # model seldom closes its reasoning: the engine's grammar tests cover the answer after it)
    r = chat(client, response_format=fmt, max_tokens=24,
             extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = r.choices[0].message
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(message.content), schema)
        assert isinstance(getattr(message, "reasoning_content", None), str)
    else:  # still reasoning at max_tokens: no answer yet, and nothing forced into the reasoning
        assert r.choices[0].finish_reason == "length"


def test_completions_take_response_format_and_guided_decoding(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": fmt})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"response_format": {"type": "yaml"}})
    error = info.value.body.get("error", info.value.body)
    assert error["param"] == "response_format"


def test_choice_extension(client):
    r = chat(client, extra_body={"guided_choice": ["yes", "no"], **NO_THINKING})
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
     "response_format.json_schema", "foo"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "fly"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"chat_template_kwargs": {"tools": 5}}, "messages", "chat template"),
])
def test_bad_input_is_a_400_naming_it(server, body, param, words):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": "tiny", "messages": USER, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
