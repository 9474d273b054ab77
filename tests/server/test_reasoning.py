"""Reasoning split: state taken from the rendered prompt, any split of the text, and the peer failures
(enable_thinking false desync, answers filed as reasoning, tool calls ending the reasoning)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashinfra.server.reasoning import ReasoningParser, prompt_opens_think
from tests.server.parsing_helpers import splits, stream, summary

TEMPLATE = Path(__file__).parent / "data" / "glm_chat_template.jinja"


@pytest.fixture(scope="module")
def glm_tokenizer():
    """The built-in model's tokenizer with a chat template in GLM-4.7's format (think and tool markers)."""
    from flashinfra.model.factory import default_model_dir
    from flashinfra.server.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir())
    tok.chat_template = TEMPLATE.read_text()
    return tok


@pytest.mark.parametrize("prompt, opened", [
    ("<|user|>hi<|assistant|><think>", True),
    ("<|user|>hi<|assistant|></think>", False),
    ("<|user|>hi<|assistant|>", False),
    ("<|assistant|><think>old</think>answer<|user|>hi<|assistant|><think>", True),
    ("<|assistant|><think>old reasoning never closed<|user|>hi<|assistant|>", False),  # history only
    ("<|assistant|><think>a</think>x<|user|>hi<|assistant|></think>", False),
])
def test_prompt_opens_think(prompt, opened):
    assert prompt_opens_think(prompt) is opened


@pytest.mark.parametrize("enable_thinking, opened", [(None, True), (True, True), (False, False)])
def test_parser_state_follows_the_rendered_template(glm_tokenizer, enable_thinking, opened):
    # vLLM #54744: with enable_thinking false the template closes the reasoning; a parser that assumed an
    # open <think> filed the whole answer as reasoning.
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = glm_tokenizer.encode_chat([{"role": "user", "content": "Hi"}], True, kwargs)
    tail = glm_tokenizer.decode(ids[-16:], skip_special_tokens=False)
    assert prompt_opens_think(tail) is opened
    result, _ = stream(["The answer is 4."], think_open=prompt_opens_think(tail))
    if opened:  # the model never closed the reasoning and stopped: that was the answer (next test)
        assert result["reasoning"] == "The answer is 4."
    else:
        assert summary(result) == {"reasoning": "", "content": "The answer is 4.", "calls": []}


def test_skipped_thinking_then_stop_is_the_answer():
    # SGLang #37645: the model skipped thinking and stopped; the answer came back as reasoning_content.
    _, parser = stream(["Paris is the ", "capital."], think_open=True)
    message = parser.message()
    assert message["content"] == "Paris is the capital."
    assert "reasoning_content" not in message


def test_unclosed_reasoning_cut_by_length_stays_reasoning():
    _, parser = stream(["Let me think about"], think_open=True, finish_reason="length")
    assert parser.message()["reasoning_content"] == "Let me think about"
    assert parser.message()["content"] == ""


def test_streamed_skip_ends_with_the_answer_as_content():
    result, _ = stream(["Paris", "."], think_open=True)
    assert result["content"] == "Paris."


RECORDED = {
    "template_opened": (True, "Weighing it up.\nDone.</think>\n\nThe answer is 4.",
                        {"reasoning": "Weighing it up.\nDone.", "content": "The answer is 4.", "calls": []}),
    "model_opened": (False, "  <think>hmm</think>Yes.",
                     {"reasoning": "hmm", "content": "Yes.", "calls": []}),
    "closed_by_template": (False, "No thinking here. <think> is text now",
                           {"reasoning": "", "content": "No thinking here. <think> is text now", "calls": []}),
    "tool_call_ends_reasoning": (True, "need data<tool_call>now</tool_call>",
                                 {"reasoning": "need data", "content": "", "calls": [("now", {})]}),
    "reasoning_then_call": (True, "plan</think><tool_call>get_weather<arg_key>days</arg_key><arg_value>2"
                                  "</arg_value></tool_call>",
                            {"reasoning": "plan", "content": "", "calls": [("get_weather", {"days": 2})]}),
    "empty_reasoning": (True, "</think>Hi", {"reasoning": "", "content": "Hi", "calls": []}),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_every_split_point(name):
    think_open, text, expected = RECORDED[name]
    for cut in range(len(text) + 1):
        assert summary(stream([text[:cut], text[cut:]], think_open=think_open)[0]) == expected, f"split at {cut}"


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(RECORDED)), cuts=st.lists(st.integers(0, 10_000), max_size=30))
def test_recorded_any_splits(name, cuts):
    think_open, text, expected = RECORDED[name]
    assert summary(stream(splits(text, cuts), think_open=think_open)[0]) == expected


def test_think_marker_prefix_is_held_back_then_released():
    parser = ReasoningParser(think_open=False)
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("s is not a tag") == ("", "<this is not a tag")
