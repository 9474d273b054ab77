"""What a chat request asks of its output's shape, as a ``GrammarSpec`` for the engine (or None).

Owns the request-side rules of structured output and tool choice: ``response_format`` (``text``,
``json_object``, ``json_schema``: its schema enforced unless ``strict`` is false, as OpenAI documents;
a function tool's ``strict: false`` likewise leaves its arguments free JSON, which xgrammar's tool tag
does), the ``guided_regex`` / ``guided_choice`` extensions, and ``tool_choice`` (``none`` and ``auto``
leave the output free; ``required`` and a named function become an xgrammar structural tag in GLM-4.7's
tool-call format, with a leading reasoning block when the prompt left ``<think>`` open). When the prompt
left ``<think>`` open, the other grammars apply to the answer after ``</think>`` (``after_think``). Every
spec is checked here so that an invalid schema, an unknown tool or a conflicting combination is a 400
naming the parameter; the engine compiles the spec against the tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from flashinfra.engine.grammar import validate_spec
from flashinfra.engine.sched.messages import GrammarSpec
from flashinfra.server.errors import bad_request


def tool_names(tools: list[dict] | None) -> list[str]:
    return [(t.get("function") or {}).get("name", "") for t in tools or []]


def check_tools(tools: list[dict] | None, tool_choice: Any) -> None:
    """400 for tools that are not function tools, and for a tool_choice that names no given tool."""
    for i, tool in enumerate(tools or []):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or not function.get("name"):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                              "tools")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    if tool_choice in (None, "none", "auto"):
        return
    if not tools:
        raise bad_request(f"tool_choice {json.dumps(tool_choice)} needs tools, and the request has none",
                          "tool_choice")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in tool_names(tools):
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"({', '.join(tool_names(tools))})", "tool_choice")


def tools_enabled(tools: list[dict] | None, tool_choice: Any) -> bool:
    """Whether tool calls in the output are parsed into ``tool_calls``."""
    return bool(tools) and tool_choice != "none"


def _tool_grammar(tools: list[dict], tool_choice: Any, think_open: bool, parallel: bool) -> GrammarSpec:
    from xgrammar import get_model_structural_tag

    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        choice: Any = {"type": "function", "function": {"name": name}}
    else:
        choice = "required"
    # the structural tag builder wants plain function tools; unknown OpenAI fields are dropped
    clean = [{"type": "function", "function": {k: v for k, v in t["function"].items()
                                                if k in ("name", "description", "parameters", "strict")}}
             for t in tools]
    def tag(token_markers: bool) -> str:
        try:
            return get_model_structural_tag(
                "glm_4_7", tools=clean, tool_choice=choice, reasoning="enabled" if think_open else "disabled",
                token_markers=token_markers, max_whitespace_cnt=1, parallel_tool_calls=parallel).model_dump_json()
        except Exception as exc:
            raise bad_request(f"the tools cannot be turned into a grammar: {exc}", "tools") from exc

    # The markers are matched as their dedicated tokens, which only the engine (with the tokenizer) can
    # resolve; the same tag with text markers checks the tools' schemas here.
    _checked(GrammarSpec("structural_tag", tag(False)), "tools")
    return GrammarSpec("structural_tag", tag(True))


def _checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    try:
        validate_spec(spec)
    except ValueError as exc:
        raise bad_request(f"invalid {param}: {exc}", param) from exc
    return spec


def response_grammar(response_format: dict | None, guided_regex: str | None,
                     guided_choice: list[str] | None) -> GrammarSpec | None:
    """The grammar of ``response_format`` and the regex/choice extensions (at most one of them)."""
    kind = (response_format or {}).get("type", "text")
    asked = [name for name, on in (("response_format", kind != "text"), ("guided_regex", guided_regex is not None),
                                   ("guided_choice", guided_choice is not None)) if on]
    if len(asked) > 1:
        raise bad_request(f"only one of {', '.join(asked)} may be given", asked[1])
    if guided_regex is not None:
        return _checked(GrammarSpec("regex", guided_regex), "guided_regex")
    if guided_choice is not None:
        return _checked(GrammarSpec("choice", json.dumps(guided_choice)), "guided_choice")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                          "response_format")
    block = response_format.get("json_schema")
    if not isinstance(block, dict) or not isinstance(block.get("schema", {}), dict):
        raise bad_request('response_format.json_schema must be {"name": ..., "schema": {...}}',
                          "response_format.json_schema")
    schema = block.get("schema", {})
    try:
        import jsonschema  # optional: a full metaschema check when the library is present
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise bad_request(f"invalid response_format.json_schema: {exc.message}",
                              "response_format.json_schema") from exc
    strict = block.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be true or false", "response_format.json_schema")
    if strict is False:
        # OpenAI: the schema then guides the model without being guaranteed; the output is still JSON of the
        # schema's top-level type, and the schema need not lie in what the grammar library compiles
        root = schema.get("type")
        if isinstance(root, str) and root != "object":
            return GrammarSpec("json_schema", json.dumps({"type": root}))
        return GrammarSpec("json_object")
    return _checked(GrammarSpec("json_schema", json.dumps(schema)), "response_format.json_schema")


def chat_grammar(*, tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool, think_open: bool,
                 response_format: dict | None, guided_regex: str | None = None,
                 guided_choice: list[str] | None = None) -> GrammarSpec | None:
    """The one grammar a chat request's output follows, or None for free text."""
    check_tools(tools, tool_choice)
    shaped = response_grammar(response_format, guided_regex, guided_choice)
    forced = tools and (tool_choice == "required" or isinstance(tool_choice, dict))
    if forced and shaped is not None:
        raise bad_request("tool_choice required or a named function cannot be combined with response_format "
                          "or guided decoding", "tool_choice")
    if forced:
        return _tool_grammar(tools, tool_choice, think_open, parallel_tool_calls)
    if shaped is not None and think_open:
        # the model reasons first; the shape is the answer's, after </think>
        return msgspec.structs.replace(shaped, after_think=True)
    return shaped
