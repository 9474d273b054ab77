"""OpenAI request schemas (pydantic, strict types) and their translation into engine sampling parameters.

Owns what a request may say and what it means: the JSON shapes of ``/v1/completions`` and
``/v1/chat/completions`` (OpenAI fields plus vLLM-style extras such as ``top_k``), range checks that give
a 400 naming the field, and ``SamplingParams`` for each of the ``n`` sub-requests. Response bodies are
built in ``serving.py``; HTTP error formatting lives in ``errors.py``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flashinfra.engine.sched.messages import SamplingParams

MAX_N = 16  # choices per request; more is refused rather than queued
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one batched /v1/completions request

Finite = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
StopStr = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class KVTransferParams(BaseModel):
    """Disaggregated serving (set by ``flashinfra router``): ``export`` on a prefill-role server sends the
    prompt's cache to the decode engine at ``peer``; ``import`` on a decode-role server continues from it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["export", "import"]
    transfer_id: Annotated[str, Field(min_length=1, max_length=128)]
    peer: Annotated[str, Field(max_length=256)] = ""
    encoder: Annotated[str, Field(max_length=256)] = ""  # export: the encode engine for the prompt's images


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: Finite = Field(1.0, ge=0.0, le=100.0)
    top_p: Finite = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=2**31)  # -1 also means off (vLLM's spelling)
    min_p: Finite = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Finite = Field(1.0, gt=0.0, le=100.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # extension: each choice also carries its generated token ids
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Finite] | None = None
    kv_transfer_params: KVTransferParams | None = None  # extension: disaggregated serving
    response_format: dict[str, Any] | None = None  # on completions too, as vLLM takes it
    guided_regex: str | None = None  # extension: the output matches this regular expression
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None  # extension

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, num_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=num_logprobs,
        )


class CompletionRequest(_SamplingFields):
    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_rules(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (choices are not re-ranked)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs are not computed)")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each as text or as token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class MediaURL(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    """An image: a ``data:image/...;base64,`` URL, or http(s) from an allowed host (``server/media.py``)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["image_url"]
    image_url: MediaURL


class VideoPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["video_url"]
    video_url: MediaURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str = "{}"  # a JSON object, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn (history sent back by the client)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=256)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=256)] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: tool-call arguments as a mapping (GLM's template walks
        ``arguments.items()``), earlier reasoning as ``reasoning_content``."""
        content = self.content
        if isinstance(content, list):
            # images and videos become the marks GLM's template writes for them (server/media.py fills them)
            from flashinfra.multimodal.prompt import IMAGE_PART, VIDEO_PART

            content = "".join(part.text if isinstance(part, TextPart) else
                              IMAGE_PART if isinstance(part, ImagePart) else VIDEO_PART for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments or "{}")
                except ValueError as exc:
                    raise ValueError(f"tool call {call.function.name!r}: arguments are not JSON ({exc})") from None
                if not isinstance(arguments, dict):
                    raise ValueError(f"tool call {call.function.name!r}: arguments must be a JSON object")
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments},
                              "name": call.function.name, "arguments": arguments})
            message["tool_calls"] = calls
        return message


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef




class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=512)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def tool_dicts(self) -> list[dict] | None:
        """The tools as plain dicts (what templates and grammars read)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def effective_tool_choice(self) -> Any:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def sub_request_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request: choice 0 keeps the request's seed (so n=1 and n>1
    agree on it); the others get distinct seeds derived deterministically from it."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63
