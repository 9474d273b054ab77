"""GLM tool-call parsing: recorded-format outputs split at every boundary, streamed as OpenAI deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashinfra.server.tool_calls import ToolCallParser, typed_value
from tests.server.parsing_helpers import splits, stream, summary

# Outputs written from GLM-4.7's format (what the template renders for tool calls in history).
RECORDED = {
    "one_call": (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
        {"reasoning": "", "content": "", "calls": [("get_weather", {"city": "Paris", "days": 3})]}),
    "text_then_two_calls_newlines": (
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New \"York\" <b></arg_value>\n"
        "<arg_key>units</arg_key><arg_value>F</arg_value>\n</tool_call>\n<tool_call>now</tool_call>",
        {"reasoning": "", "content": "Let me check.\n",
         "calls": [("get_weather", {"city": 'New "York" <b>', "units": "F"}), ("now", {})]}),
    "zero_argument_call": (
        "<tool_call>now</tool_call>",
        {"reasoning": "", "content": "", "calls": [("now", {})]}),
    "typed_values": (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value>"
        "<arg_key>detail</arg_key><arg_value>true</arg_value><arg_key>hours</arg_key><arg_value>[1, 2]</arg_value>"
        "<arg_key>where</arg_key><arg_value>{\"lat\": 1.5}</arg_value>"
        "<arg_key>days</arg_key><arg_value>soon</arg_value>"
        "<arg_key>extra</arg_key><arg_value>null</arg_value></tool_call>",
        {"reasoning": "", "content": "", "calls": [("get_weather", {"city": "123", "detail": True, "hours": [1, 2],
                                                                  "where": {"lat": 1.5}, "days": "soon",
                                                                  "extra": None})]}),
    "reasoning_then_call": (
        "<think>The user wants weather.</think>\n<tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Oslo</arg_value></tool_call>",
        {"reasoning": "The user wants weather.", "content": "", "calls": [("get_weather", {"city": "Oslo"})]}),
    "call_inside_think": (  # the call ends the reasoning instead of being swallowed by it
        "<think>I should call the tool <tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
        "</tool_call>",
        {"reasoning": "I should call the tool ", "content": "", "calls": [("get_weather", {"city": "Rome"})]}),
    "plain_answer": (
        "It is sunny < 30 degrees </tool and <arg.",
        {"reasoning": "", "content": "It is sunny < 30 degrees </tool and <arg.", "calls": []}),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_output_parses(name):
    text, expected = RECORDED[name]
    result, parser = stream([text])
    assert summary(result) == expected
    assert parser.finish_reason("stop") == ("tool_calls" if expected["calls"] else "stop")
    message = parser.message()
    assert [json.loads(c["function"]["arguments"]) for c in message.get("tool_calls", [])] == \
        [args for _, args in expected["calls"]]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_single_split_point(name):
    text, expected = RECORDED[name]
    for cut in range(len(text) + 1):
        assert summary(stream([text[:cut], text[cut:]])[0]) == expected, f"split at {cut}"


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_character_by_character(name):
    text, expected = RECORDED[name]
    assert summary(stream(list(text))[0]) == expected


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(RECORDED)), cuts=st.lists(st.integers(0, 10_000), max_size=40))
def test_any_splits_give_the_same_result(name, cuts):
    text, expected = RECORDED[name]
    result, parser = stream(splits(text, cuts))
    assert summary(result) == expected
    # the streamed argument fragments concatenate to exactly the final arguments
    assert [a for _, _, a in result["calls"]] == [c.arguments for c in parser.calls]


def test_zero_argument_call_is_streamed_with_name_and_empty_object():
    # vLLM #44326: zero-argument calls were dropped when streaming
    pieces = ["<tool_", "call>n", "ow", "</tool_", "call>"]
    result, _ = stream(pieces)
    assert [(name, args) for _, name, args in result["calls"]] == [("now", "{}")]


def test_name_is_sent_before_arguments_finish():
    parser = ToolCallParser(None)
    out = parser.feed("<tool_call>get_weather<arg_key>ci")
    assert [d.name for d in out if d.name] == ["get_weather"]
    assert parser.calls[0].arguments == ""


def test_string_values_stream_before_the_value_closes():
    from tests.server.parsing_helpers import WEATHER_TOOLS

    parser = ToolCallParser(WEATHER_TOOLS)
    parser.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Buenos Aires and more")
    assert parser.calls[0].arguments == '{"city": "Buenos Aires and more'


def test_unfinished_call_is_closed_at_the_end():
    result, _ = stream(["<tool_call>get_weather<arg_key>city</arg_key><arg_value>Li"], finish_reason="length")
    assert summary(result)["calls"] == [("get_weather", {"city": "Li"})]


def test_tools_disabled_leaves_markers_as_content():
    text = "<tool_call>now</tool_call>"
    result, _ = stream([text], tools_enabled=False)
    assert result == {"reasoning": "", "content": text, "calls": []}


@pytest.mark.parametrize("raw, expected", [("3", "3"), (" [1, 2] ", "[1, 2]"), ("not json", '"not json"'),
                                           ("{\"a\": \"é\"}", '{"a": "é"}')])
def test_typed_value(raw, expected):
    assert typed_value(raw) == expected
