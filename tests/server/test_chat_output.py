"""Token ids -> detokenizer -> output parser, with several tokens per step (speculative decoding), and the
chat formatter's OpenAI shapes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashinfra.server.chat_output import ChatOutputParser, MarkerDecoder
from flashinfra.server.detokenizer import IncrementalDetokenizer
from tests.server.parsing_helpers import WEATHER_TOOLS, assemble, summary
from tests.server.test_reasoning import RECORDED as REASONING
from tests.server.test_tool_calls import RECORDED as TOOLS

CASES = {**{f"tools.{k}": (False, *v) for k, v in TOOLS.items()}, **{f"reasoning.{k}": v for k, v in REASONING.items()}}


@pytest.fixture(scope="module")
def tok():
    from flashinfra.model.factory import default_model_dir
    from flashinfra.server.tokenizer import Tokenizer

    return Tokenizer(default_model_dir())


def run_tokens(tok, ids: list[int], steps: list[int], think_open: bool, finish_reason: str = "stop") -> dict:
    """Feed ``ids`` to a detokenizer ``steps[i]`` tokens at a time (several tokens per engine step, as under
    speculation); parse every text delta."""
    detok = IncrementalDetokenizer(MarkerDecoder(tok), [], ())
    parser = ChatOutputParser(think_open, WEATHER_TOOLS, True)
    deltas, i, s = [], 0, 0
    while i < len(ids):
        size = steps[s % len(steps)] if steps else 1
        for t in ids[i:i + size]:
            detok.add_token(t)
        i += size
        s += 1
        deltas.append(parser.feed(detok.pop_delta()))
    detok.finish()
    deltas.append(parser.feed(detok.pop_delta(final=True)))
    deltas.append(parser.finish(finish_reason))
    return assemble(deltas)


def test_markers_are_single_tokens_and_survive_decoding(tok):
    ids = tok.encode("<think>a</think><tool_call>now</tool_call><|user|>", add_special_tokens=False)
    assert 4085 in ids and 4087 in ids and ids[-1] == 4076
    # every marker kept, the EOS-like <|user|> dropped
    assert MarkerDecoder(tok).decode(ids) == "<think>a</think><tool_call>now</tool_call>"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("per_step", [1, 2, 3, 5, 8])
def test_multi_token_steps(tok, name, per_step):
    # vLLM #34449: arguments corrupted when several tokens arrive in one step
    think_open, text, expected = CASES[name]
    ids = tok.encode(text, add_special_tokens=False)
    assert summary(run_tokens(tok, ids, [per_step], think_open)) == expected


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), steps=st.lists(st.integers(1, 7), min_size=1, max_size=12))
def test_any_token_grouping(tok, name, steps):
    think_open, text, expected = CASES[name]
    ids = tok.encode(text, add_special_tokens=False)
    assert summary(run_tokens(tok, ids, steps, think_open)) == expected


def test_formatter_message_and_stream_shapes(tok):
    from flashinfra.server.chat_output import ChatFormatter
    from flashinfra.server.serving import Choice, ChoiceEvent
    from flashinfra.engine.sched.messages import SamplingParams

    fmt = ChatFormatter("id", "m", tok, False, 1, think_open=True, tools=WEATHER_TOOLS, tools_enabled=True)
    choice = Choice(0, "r", [1], SamplingParams(), IncrementalDetokenizer(tok, [1]))
    chunks = [fmt.chunk(ChoiceEvent(choice, "why</thi")), fmt.chunk(ChoiceEvent(choice, "nk><tool_call>now</tool_"))]
    choice.finish_reason = "stop"
    chunks.append(fmt.chunk(ChoiceEvent(choice, "call>", finish_reason="stop")))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"reasoning_content": "why"}
    assert deltas[1] == {}  # the name may still go on: nothing is certain yet
    call = deltas[2]["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == (0, "function", {"name": "now", "arguments": "{}"})
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    final = ChatFormatter("id", "m", tok, False, 1, think_open=True, tools=WEATHER_TOOLS, tools_enabled=True)
    final.add(ChoiceEvent(choice, "why</think><tool_call>now</tool_call>", finish_reason="stop"))
    body = final.final([choice])["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["reasoning_content"] == "why"
    assert body["message"]["content"] is None
    assert body["message"]["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
