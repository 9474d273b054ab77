"""Request-side rules of structured output and tool choice: each bad input is a 400 naming its parameter."""

from __future__ import annotations

import json

import pytest

from flashinfra.server.errors import APIError
from flashinfra.server.structured import chat_grammar
from tests.server.parsing_helpers import WEATHER_TOOLS


def grammar(**kwargs):
    args = dict(tools=None, tool_choice="none", parallel_tool_calls=True, think_open=False, response_format=None)
    args.update(kwargs)
    return chat_grammar(**args)


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def test_free_text_has_no_grammar():
    assert grammar() is None
    assert grammar(tools=WEATHER_TOOLS, tool_choice="auto") is None
    assert grammar(response_format={"type": "text"}) is None


def test_response_formats():
    assert grammar(response_format={"type": "json_object"}).kind == "json_object"
    spec = grammar(response_format=schema_format({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert spec.kind == "json_schema" and json.loads(spec.spec)["properties"]["a"] == {"type": "integer"}
    assert grammar(guided_regex=r"\d{3}").kind == "regex"
    assert json.loads(grammar(guided_choice=["yes", "no"]).spec) == ["yes", "no"]


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"type": "object", "properties": 3},
                                    {"type": "integer", "minimum": "x"}, {"$ref": "#/$defs/missing"}])
def test_invalid_schema_is_a_400_naming_it(schema):
    with pytest.raises(APIError) as info:
        grammar(response_format=schema_format(schema))
    assert info.value.status == 400
    assert info.value.param == "response_format.json_schema"


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": "x"}), "response_format.json_schema"),
    (dict(guided_regex="a(b"), "guided_regex"),
    (dict(guided_choice=[""]), "guided_choice"),
    (dict(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    (dict(tools=WEATHER_TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
    (dict(tools=WEATHER_TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": 3}}], tool_choice="auto"), "tools"),
])
def test_bad_requests(kwargs, param):
    with pytest.raises(APIError) as info:
        grammar(**kwargs)
    assert (info.value.status, info.value.param) == (400, param)


def test_forced_tools_become_a_structural_tag():
    spec = grammar(tools=WEATHER_TOOLS, tool_choice="required")
    tag = json.loads(spec.spec)
    assert spec.kind == "structural_tag" and "get_weather" in spec.spec and "now" in spec.spec
    named = grammar(tools=WEATHER_TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert "now" in named.spec and "get_weather" not in named.spec
    # a reasoning block ending in </think> leads the grammar only when the prompt left <think> open
    assert tag["format"]["type"] == "token_triggered_tags"
    opened = json.loads(grammar(tools=WEATHER_TOOLS, tool_choice="required", think_open=True).spec)
    assert opened["format"]["type"] == "sequence" and "</think>" in json.dumps(opened["format"]["elements"][0])
