"""A chat completion request -> the prompt, the sampling parameters (with any grammar) and the parser settings.

Owns the chat-specific preparation between the HTTP body and ``serving.py``: the messages in the shape
chat templates read (tool calls with their arguments as mappings, tool results, earlier reasoning), the
template variables (``tools``, ``tool_choice``, then ``chat_template_kwargs`` such as ``enable_thinking`` or
``reasoning_effort``, passed through for templates that read them), whether the rendered prompt left a
``<think>`` open (decoded from the prompt's last tokens, so the reasoning parser and the grammar follow
the template, whatever the kwargs were), and the grammar of ``structured.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from flashinfra.engine.sched.messages import MultiModalItem, SamplingParams
from flashinfra.generation_defaults import apply_defaults
from flashinfra.server.errors import bad_request
from flashinfra.server.media import chat_prompt
from flashinfra.server.protocol import ChatCompletionRequest
from flashinfra.server.reasoning import prompt_opens_think
from flashinfra.server.serving import ServerState, check_prompt, tokenize
from flashinfra.server.structured import chat_grammar, tools_enabled

# The generation prompt's tail that decides whether <think> is open ("<|assistant|>" plus a marker or two).
_PROMPT_TAIL_TOKENS = 16


@dataclass
class PreparedChat:
    prompt_ids: list[int]
    sampling: SamplingParams
    think_open: bool
    tools: list[dict] | None
    tools_enabled: bool
    mm_items: list[MultiModalItem]


def template_messages(body: ChatCompletionRequest) -> list[dict]:
    messages = []
    for i, msg in enumerate(body.messages):
        try:
            messages.append(msg.as_template_dict())
        except ValueError as exc:
            raise bad_request(f"messages[{i}]: {exc}", "messages") from exc
    return messages


def template_variables(body: ChatCompletionRequest) -> dict:
    variables: dict = {}
    tools = body.tool_dicts
    if tools and body.effective_tool_choice != "none":
        variables["tools"] = tools
        variables["tool_choice"] = body.effective_tool_choice
    variables.update(body.chat_template_kwargs or {})
    return variables


async def prepare_chat(state: ServerState, body: ChatCompletionRequest, defaults: dict) -> PreparedChat:
    """``defaults``: the checkpoint's generation defaults (``generation_defaults``) for the fields the body leaves
    out."""
    messages, variables = template_messages(body), template_variables(body)
    multimodal = await chat_prompt(state, body.messages, messages, body.add_generation_prompt, variables)
    if multimodal is None:
        prompt_ids = await tokenize(state, "", chat=messages, add_generation_prompt=body.add_generation_prompt,
                                    template_kwargs=variables)
        mm_items: list[MultiModalItem] = []
    else:
        prompt_ids, mm_items = multimodal
    max_tokens = check_prompt(state, prompt_ids, body.requested_max_tokens, defaults.get("max_tokens"), "messages")
    tail = state.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    think_open = prompt_opens_think(tail)
    tools, choice = body.tool_dicts, body.effective_tool_choice
    grammar = chat_grammar(tools=tools, tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
                           think_open=think_open, response_format=body.response_format,
                           guided_regex=body.guided_regex, guided_choice=body.guided_choice)
    sampling = apply_defaults(body.sampling_params(max_tokens, body.num_logprobs), defaults, body.model_fields_set)
    if grammar is not None:
        sampling = msgspec.structs.replace(sampling, grammar=grammar)
    return PreparedChat(prompt_ids, sampling, think_open, tools, tools_enabled(tools, choice), mm_items)
