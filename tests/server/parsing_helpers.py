"""Helpers of the output-parser tests: feed a text in pieces through ``ChatOutputParser`` and assemble the
streamed deltas the way an OpenAI client does."""

from __future__ import annotations

import json

from flashinfra.server.chat_output import ChatOutputParser

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "units": {"type": "string", "enum": ["C", "F"]}, "detail": {"type": "boolean"},
                       "hours": {"type": "array", "items": {"type": "integer"}},
                       "where": {"type": "object"}, "code": {"type": "string"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


def assemble(deltas: list[dict]) -> dict:
    """Streamed delta dicts -> {"reasoning", "content", "calls": [(id, name, arguments)]}."""
    reasoning, content, calls = [], [], {}
    for d in deltas:
        reasoning.append(d.get("reasoning_content", ""))
        content.append(d.get("content", ""))
        for entry in d.get("tool_calls", []):
            i = entry["index"]
            if "id" in entry:
                assert i not in calls, "a call's header was sent twice"
                calls[i] = [entry["id"], entry["function"]["name"], entry["function"]["arguments"]]
            else:
                assert i in calls, "arguments streamed before the call's name"
                calls[i][2] += entry["function"]["arguments"]
    return {"reasoning": "".join(reasoning), "content": "".join(content),
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def stream(pieces: list[str], think_open: bool = False, tools=WEATHER_TOOLS, tools_enabled: bool = True,
           finish_reason: str = "stop") -> tuple[dict, ChatOutputParser]:
    parser = ChatOutputParser(think_open, tools, tools_enabled)
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish(finish_reason))
    return assemble(deltas), parser


def summary(result: dict) -> dict:
    """A result without the random call ids, arguments decoded."""
    return {"reasoning": result["reasoning"], "content": result["content"],
            "calls": [(name, json.loads(args)) for _, name, args in result["calls"]]}


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]
