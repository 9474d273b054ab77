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


def test_with_reasoning_open_the_shape_applies_after_think():
    for kwargs in (dict(response_format={"type": "json_object"}), dict(guided_regex=r"\d+"),
                   dict(response_format=schema_format({"type": "object"}))):
        assert grammar(think_open=True, **kwargs).after_think
        assert not grammar(think_open=False, **kwargs).after_think
    # forced tool calls carry their own reasoning block
    assert not grammar(tools=WEATHER_TOOLS, tool_choice="required", think_open=True).after_think


def test_json_schema_strict_false_leaves_the_schema_unenforced():
    unsupported = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    with pytest.raises(APIError):  # enforced (strict or not said): the grammar library must compile it
        grammar(response_format=schema_format(unsupported))
    loose = {"type": "json_schema", "json_schema": {"name": "x", "schema": unsupported, "strict": False}}
    assert grammar(response_format=loose).kind == "json_object"
    listed = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}, "strict": False}}
    spec = grammar(response_format=listed)
    assert (spec.kind, json.loads(spec.spec)) == ("json_schema", {"type": "array"})
    with pytest.raises(APIError):  # still a valid JSON schema
        grammar(response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": {"type": "foo"}, "strict": False}})
    not_bool = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "no"}}
    with pytest.raises(APIError):
        grammar(response_format=not_bool)


def test_tool_strict_false_leaves_its_arguments_free():
    def tools(strict):
        function = {"name": "f", "parameters": {"type": "object", "properties": {"zzz": {"type": "integer"}}}}
        return [{"type": "function", "function": function if strict is None else {**function, "strict": strict}}]

    assert "zzz" in grammar(tools=tools(None), tool_choice="required").spec
    assert "zzz" in grammar(tools=tools(True), tool_choice="required").spec
    assert "zzz" not in grammar(tools=tools(False), tool_choice="required").spec
