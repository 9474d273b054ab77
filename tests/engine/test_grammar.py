"""Constrained decoding: xgrammar masks from the built-in model's tokenizer, applied by the sampler, give
outputs that always follow the grammar (random logits stand in for a model that does not know JSON)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashinfra.engine.grammar import GrammarRuntime
from flashinfra.engine.sampler import SamplingRow, sample
from flashinfra.engine.sched.messages import GrammarSpec, SamplingParams

EOS = [4069, 4076, 4078]
V = 4096


@pytest.fixture(scope="module")
def runtime():
    from flashinfra.model.factory import default_model_dir

    return GrammarRuntime.for_model(default_model_dir(), V, EOS)


@pytest.fixture(scope="module")
def tok():
    from flashinfra.model.factory import default_model_dir
    from flashinfra.server.tokenizer import Tokenizer

    return Tokenizer(default_model_dir())


def decode_constrained(runtime, spec: GrammarSpec, seed: int, request_id: str, max_steps: int = 400,
                       eos_bonus: float = 4.0) -> list[int]:
    """Greedy decoding over random logits (EOS favoured, so outputs end once the grammar allows it)."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, grammar=spec)
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, V, generator=g)
        logits[0, EOS] += eos_bonus
        mask = runtime.prepare([(request_id, spec, out)])
        tokens, _, errors = sample(logits, [SamplingRow(params, [1], out, None)], mask)
        assert errors == [None], errors
        out.append(tokens[0])
        if tokens[0] in EOS:
            runtime.release([request_id])
            return out
    raise AssertionError(f"no EOS after {max_steps} tokens")


# Every value bounded, so that random logits reach the end of the grammar.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer",
                                      "minimum": 0, "maximum": 150}}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"const": "point"}, "xy": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "integer", "minimum": 0, "maximum": 9}],
        "items": False}}, "required": ["kind", "xy"]},
]


@settings(max_examples=16, deadline=None)
@given(which=st.integers(0, len(SCHEMAS) - 1), seed=st.integers(0, 2**31))
def test_json_schema_outputs_always_validate(runtime, tok, which, seed):
    schema = SCHEMAS[which]
    ids = decode_constrained(runtime, GrammarSpec("json_schema", json.dumps(schema)), seed, f"s{which}-{seed}")
    jsonschema.validate(json.loads(tok.decode(ids[:-1])), schema)


def test_json_object_regex_and_choice(runtime, tok):
    for seed in range(3):
        obj = json.loads(tok.decode(decode_constrained(runtime, GrammarSpec("json_object"), seed, "o",
                                                       eos_bonus=8.0)[:-1]))
        assert isinstance(obj, dict)
        text = tok.decode(decode_constrained(runtime, GrammarSpec("regex", r"[A-Z][a-z]{2,5} \d{2}"), seed, "r")[:-1])
        assert re.fullmatch(r"[A-Z][a-z]{2,5} \d{2}", text), text
        text = tok.decode(decode_constrained(runtime, GrammarSpec("choice", json.dumps(["yes", "no", "a.b"])),
                                             seed, "c")[:-1])
        assert text in ("yes", "no", "a.b")


def test_required_tool_call_grammar_gives_a_valid_call(runtime, tok):
    from flashinfra.server.chat_output import MarkerDecoder
    from flashinfra.server.structured import chat_grammar
    from flashinfra.server.tool_calls import ToolCallParser

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
                                         "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}]
    spec = chat_grammar(tools=tools, tool_choice="required", parallel_tool_calls=False, think_open=False,
                        response_format=None)
    for seed in range(4):
        ids = decode_constrained(runtime, spec, seed, f"t{seed}")
        assert ids[0] == 4087  # <tool_call> as its own token
        parser = ToolCallParser(tools)
        parser.feed(MarkerDecoder(tok).decode(ids))
        parser.finish()
        assert len(parser.calls) == 1 and parser.calls[0].name == "get_weather"
        jsonschema.validate(json.loads(parser.calls[0].arguments), tools[0]["function"]["parameters"])


def test_after_think_reasons_freely_then_follows_the_grammar(runtime, tok):
    """Before </think>: free text that cannot stop (EOS strongly favoured, still never sampled) nor open a
    tool call; from the token after it, the schema; a reasoning that never ends stays unconstrained."""
    schema = SCHEMAS[0]
    spec = GrammarSpec("json_schema", json.dumps(schema), after_think=True)
    think_end, tool_call = runtime.think_end_id, 4087  # </think>, <tool_call>
    assert think_end is not None
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=0.0, grammar=spec)
        out: list[int] = []
        for step in range(400):
            logits = torch.randn(1, V, generator=g)
            logits[0, EOS] += 20.0
            logits[0, tool_call] += 20.0
            if step >= 6:
                logits[0, think_end] += 10.0
            mask = runtime.prepare([(f"a{seed}", spec, out)])
            tokens, _, errors = sample(logits, [SamplingRow(params, [1], out, None)], mask)
            assert errors == [None], errors
            out.append(tokens[0])
            if tokens[0] in EOS:
                break
        runtime.release([f"a{seed}"])
        end = out.index(think_end)
        assert end == 6 and tool_call not in out and not set(out[:end]) & set(EOS)
        jsonschema.validate(json.loads(tok.decode(out[end + 1:-1])), schema)


def test_mixed_batch_leaves_free_rows_alone_and_confines_errors(runtime):
    spec = GrammarSpec("choice", json.dumps(["yes"]))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    free = SamplingParams(temperature=0.0)
    rows = [SamplingRow(free, [1], [], None), SamplingRow(SamplingParams(temperature=0.0, grammar=spec), [1], [], None),
            SamplingRow(SamplingParams(temperature=0.0, grammar=spec), [1], [5], None)]  # 5 breaks the grammar
    mask = runtime.prepare([("free", None, []), ("ok", spec, []), ("bad", spec, [5])])
    tokens, _, errors = sample(logits.clone(), rows, mask)
    assert tokens[0] == int(logits[0].argmax())
    assert errors[1] is None and tokens[1] != int(logits[1].argmax())
    assert errors[2] is not None and "grammar" in errors[2]
    runtime.release(["free", "ok", "bad"])
    assert runtime.num_tracked == 0


def test_compiled_grammars_are_cached(runtime):
    spec = GrammarSpec("regex", "x+")
    assert runtime.compile(spec) is runtime.compile(GrammarSpec("regex", "x+"))


def test_pack_bits_matches_xgrammar_layout():
    import xgrammar as xgr

    from flashinfra.engine.grammar import pack_bits

    allowed = torch.rand(100, generator=torch.Generator().manual_seed(0)) > 0.5
    logits = torch.zeros(1, 100)
    xgr.apply_token_bitmask_inplace(logits, pack_bits(allowed)[None], vocab_size=100)
    assert torch.equal(logits[0] == 0, allowed)
