"""One HTTP request's life in the engine: prompts -> sub-requests -> decoded, stop-checked choice events.

Owns the request-level logic shared by completions and chat: tokenizing prompts off the event loop,
checking lengths against the context, fanning a request out into ``n`` sub-requests per prompt (seeds
derived deterministically), streaming engine outputs through one incremental detokenizer per choice,
aborting a choice in the engine as soon as a stop string ends it, aborting everything when the client
goes away, and recording latency metrics. The OpenAI JSON shapes are built in ``formatting.py``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request

from flashinfra.engine.sched.messages import RequestOutput, SamplingParams
from flashinfra.server.detokenizer import IncrementalDetokenizer
from flashinfra.server.engine_client import (ENGINE_UNAVAILABLE, EngineClient, EngineDeadError, NeverFitsError,
                                             QueueFullError)
from flashinfra.server.errors import APIError, bad_request
from flashinfra.server.metrics import ServerMetrics
from flashinfra.server.protocol import sub_request_seed
from flashinfra.server.tokenizer import Tokenizer

# Prompts shorter than this are tokenized inline; longer ones in the thread pool, so one huge prompt
# never stalls the event loop that streams everyone else's tokens.
_INLINE_TOKENIZE_CHARS = 2048
# A text longer than this many characters per context token cannot fit the context whatever it says, and is
# refused before tokenizing (tokenizing megabytes would only burn CPU to find that out).
_MAX_CHARS_PER_TOKEN = 64
_DISCONNECTED = object()


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    executor: ThreadPoolExecutor
    vocab_size: int
    media: object = None  # server.media.MediaSettings when images/video are accepted


@dataclass
class Choice:
    """One sub-request: a prompt x one of its ``n`` samples."""

    index: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    finish_reason: str | None = None
    error: str | None = None
    num_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    mm_items: list = field(default_factory=list)  # the prompt's images/videos (engine MultiModalItem)
    transfer: object = None  # engine TransferParams under disaggregated serving (server.disagg)


@dataclass
class ChoiceEvent:
    """What one engine output meant for one choice: new text, the logprobs of its new tokens (token id,
    logprob, top list, text offset), and the finish reason when it just finished."""

    choice: Choice
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]], int]] = field(default_factory=list)
    finish_reason: str | None = None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def tokenize(state: ServerState, text: str, chat: list[dict] | None = None,
                   add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
    """Text or chat messages -> token ids; large inputs go to the thread pool."""
    tok = state.tokenizer
    if chat is not None:
        work = lambda: tok.encode_chat(chat, add_generation_prompt, template_kwargs)  # noqa: E731
        size = sum(len(msg.get("content") or "") for msg in chat)
    else:
        work = lambda: tok.encode(text)  # noqa: E731
        size = len(text)
    if size > state.max_model_len * _MAX_CHARS_PER_TOKEN:
        raise bad_request(f"the {'messages are' if chat is not None else 'prompt is'} {size} characters long, "
                          f"far beyond this model's maximum context length of {state.max_model_len} tokens",
                          "messages" if chat is not None else "prompt")
    try:
        if size < _INLINE_TOKENIZE_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(state.executor, work)
    except ValueError as exc:  # ChatTemplateError and tokenizer input errors
        raise bad_request(str(exc), "messages" if chat is not None else "prompt") from exc


def check_prompt(state: ServerState, prompt_ids: list[int], max_tokens: int | None, default_max: int | None,
                 param: str = "prompt") -> int:
    """Validate a tokenized prompt against the context; return the max_tokens to use."""
    if not prompt_ids:
        raise bad_request("the prompt is empty (it has no tokens)", param)
    bad = next((t for t in prompt_ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {state.vocab_size})", param)
    room = state.max_model_len - len(prompt_ids)
    if room < 1:
        raise bad_request(f"this model's maximum context length is {state.max_model_len} tokens, but the "
                          f"prompt has {len(prompt_ids)} tokens (no room for output)", param)
    if max_tokens is None:
        return min(default_max, room) if default_max is not None else room
    if max_tokens > room:
        raise bad_request(f"this model's maximum context length is {state.max_model_len} tokens; the prompt "
                          f"has {len(prompt_ids)} tokens and max_tokens is {max_tokens} (at most {room} fit)",
                          "max_tokens")
    return max_tokens


def make_choices(state: ServerState, request_id: str, prompts: list[list[int]], sampling: list[SamplingParams],
                 n: int, stop: list[str], include_stop: bool, skip_special_tokens: bool,
                 decoder=None) -> list[Choice]:
    """Fan prompts out into ``n`` sub-requests each; choice index = prompt index * n + sample index.
    ``decoder``: what the detokenizers decode with (default: the tokenizer)."""
    choices = []
    for p, (prompt_ids, params) in enumerate(zip(prompts, sampling)):
        try:
            params.validate(state.max_model_len)
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        bad = next((t for t in params.stop_token_ids if t >= state.vocab_size), None)
        if bad is not None:
            raise bad_request(f"stop token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                              "stop_token_ids")
        for i in range(n):
            sp = params if i == 0 else msgspec.structs.replace(params, seed=sub_request_seed(params.seed, i))
            detok = IncrementalDetokenizer(decoder or state.tokenizer, prompt_ids, stop, include_stop,
                                           skip_special_tokens)
            choices.append(Choice(index=p * n + i, request_id=f"{request_id}-{p}-{i}", prompt_ids=prompt_ids,
                                  sampling=sp, detok=detok))
    return choices


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_DISCONNECTED)
            return


async def submit(state: ServerState, choices: list[Choice]) -> asyncio.Queue:
    """Send every choice to the engine; outputs of all of them arrive on the returned queue."""
    client = state.client
    try:
        client.reserve(len(choices))
    except NeverFitsError as exc:
        raise bad_request(str(exc), "n") from exc
    except QueueFullError as exc:
        state.metrics.rejected.labels("429").inc()
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from exc
    queue: asyncio.Queue = asyncio.Queue()
    try:
        await client.submit([(c.request_id, c.prompt_ids, c.sampling, c.mm_items, c.transfer) for c in choices],
                            queue)
    except EngineDeadError as exc:
        state.metrics.rejected.labels("503").inc()
        raise APIError(503, f"{ENGINE_UNAVAILABLE}{exc}", code="engine_unavailable",
                       headers={"Retry-After": "5"}) from exc
    # n choices of one prompt share its token list: count each prompt once.
    state.metrics.prompt_tokens.inc(sum({id(c.prompt_ids): len(c.prompt_ids) for c in choices}.values()))
    return queue


async def run_choices(state: ServerState, request: Request, choices: list[Choice], queue: asyncio.Queue,
                      arrival: float) -> AsyncIterator[list[ChoiceEvent]]:
    """Turn engine outputs into choice events until every choice finished; abort what is left over if the
    consumer stops early (client gone, stream cancelled).

    Each wake-up takes every output already waiting on the queue (one engine step's, or several when this
    stream fell behind) and yields their events as one batch, so a stream costs one task wake-up and one
    socket write per batch rather than per token."""
    by_id = {c.request_id: c for c in choices}
    unfinished = set(by_id)
    watcher = asyncio.create_task(_watch_disconnect(request, queue))
    try:
        while unfinished:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            if _DISCONNECTED in items:
                return
            events = []
            for item in _merge_outputs(items):
                choice = by_id[item.request_id]
                if choice.finish_reason is not None:
                    continue
                event = _apply_output(state, choice, item, arrival)
                if event.finish_reason is not None:
                    unfinished.discard(choice.request_id)
                    if item.finished is False:  # stopped by a stop string: the engine must stop too
                        state.client.abort_soon([choice.request_id])
                    _record_finish(state, choice, arrival)
                if event.text or event.token_ids or event.finish_reason is not None:
                    events.append(event)
            if events:
                yield events
    finally:
        watcher.cancel()
        if unfinished:
            state.client.abort_soon(sorted(unfinished))


def _merge_outputs(items: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request out of several steps' worth (order kept): their tokens and logprobs joined,
    the last one's finish state."""
    merged: dict[str, RequestOutput] = {}
    for item in items:
        first = merged.get(item.request_id)
        if first is None:
            merged[item.request_id] = item
            continue
        logprobs = None
        if first.logprobs is not None or item.logprobs is not None:
            logprobs = (first.logprobs or []) + (item.logprobs or [])
        merged[item.request_id] = msgspec.structs.replace(
            item, new_token_ids=first.new_token_ids + item.new_token_ids, logprobs=logprobs)
    return list(merged.values())


def _apply_output(state: ServerState, choice: Choice, out: RequestOutput, arrival: float) -> ChoiceEvent:
    now = time.monotonic()
    event = ChoiceEvent(choice=choice, text="")
    detok = choice.detok
    if out.new_token_ids and choice.first_token_time is None:
        choice.first_token_time = now
        state.metrics.ttft.observe(now - arrival)
    if out.logprobs is None and not detok.has_stop_strings:
        if out.new_token_ids:  # the common case: one decode for all of this wake-up's tokens
            detok.add_tokens(out.new_token_ids)
            event.token_ids.extend(out.new_token_ids)
            choice.num_tokens += len(out.new_token_ids)
            choice.last_token_time = now
    else:
        for k, token_id in enumerate(out.new_token_ids):
            if detok.stopped:
                break
            offset = detok.add_token(token_id)
            event.token_ids.append(token_id)
            choice.num_tokens += 1
            choice.last_token_time = now
            if out.logprobs is not None and k < len(out.logprobs):
                lp = out.logprobs[k]
                event.logprobs.append((lp.token_id, lp.logprob, list(lp.top), offset))
    if detok.stopped:
        choice.finish_reason = "stop"
    elif out.finished:
        detok.finish()
        choice.finish_reason = out.finish_reason or "stop"
        if choice.finish_reason == "error":
            choice.error = out.error or "the engine failed this request"
    event.text = detok.pop_delta(final=choice.finish_reason is not None)
    event.finish_reason = choice.finish_reason
    return event


def _record_finish(state: ServerState, choice: Choice, arrival: float) -> None:
    m = state.metrics
    m.requests.labels(choice.finish_reason).inc()
    m.generation_tokens.inc(choice.num_tokens)
    if choice.last_token_time is not None:
        m.e2e.observe(choice.last_token_time - arrival)
        if choice.num_tokens > 1:
            m.tpot.observe((choice.last_token_time - choice.first_token_time) / (choice.num_tokens - 1))
