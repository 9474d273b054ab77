"""The FastAPI application: routes, API-key check, lifespan (engine start and stop), streaming.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (optionally SSE-streamed, with
``stream_options.include_usage``), ``GET /v1/models`` and ``GET /health`` (both 503 while the engine is
gone), ``GET /metrics`` (Prometheus, with ``flashinfra_engine_up``). Bodies are size-limited
(``server.limits``); the engine failure policy is ``server.supervisor``'s. With an API key set, every
``/v1/`` route needs ``Authorization: Bearer KEY``. Shutdown order (uvicorn's): stop accepting, let in-flight
requests finish, then the lifespan exit stops the engine, so in-flight requests drain.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from flashinfra.generation_defaults import apply_defaults, load_generation_defaults
from flashinfra.server.chat_output import ChatFormatter, MarkerDecoder
from flashinfra.server.chat_request import prepare_chat
from flashinfra.server.disagg import attach_transfer, check_embeddable, install_disagg_routes
from flashinfra.server.engine_client import ENGINE_UNAVAILABLE, EngineClient, EngineDeadError, EngineLauncher
from flashinfra.server.errors import APIError, error_body, error_response, install_error_handlers
from flashinfra.server.formatting import CompletionFormatter, sse
from flashinfra.server.limits import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from flashinfra.server.metrics import ServerMetrics
from flashinfra.server.protocol import ChatCompletionRequest, CompletionRequest
from flashinfra.server.serving import (Choice, ServerState, check_prompt, make_choices, new_request_id,
                                       run_choices, submit, tokenize)
from flashinfra.server.structured import response_grammar
from flashinfra.server.supervisor import EngineSupervisor, ServerOutcome
from flashinfra.server.tokenizer import Tokenizer

logger = logging.getLogger("flashinfra.server")


@dataclass(frozen=True)
class ServerConfig:
    """What the app is built from; the settings a user chooses come from ``serve``'s ``ServeOptions``."""

    model_path: Path
    launcher: EngineLauncher
    served_model_name: str | None
    api_key: str | None
    max_pending: int
    tokenizer_threads: int = 4
    engine_start_timeout_s: float = 900.0
    media: Any = None  # server.media.MediaSettings when the engine runs with vision; None: text only
    engine_failure: str = "restart"  # server.supervisor.POLICIES
    engine_restart_attempts: int = 3
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    outcome: ServerOutcome | None = None  # the exit code the server should end with
    startup_info: Callable[[Any], list[str]] | None = None  # EngineReady -> lines of the start-up log block


def create_app(config: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = Tokenizer(config.model_path)
        outcome = config.outcome if config.outcome is not None else ServerOutcome()
        client = EngineClient(config.launcher, max_pending=config.max_pending)
        atexit.register(client.cleanup_files)
        supervisor = EngineSupervisor(client, config.engine_failure, outcome, config.engine_restart_attempts,
                                      start_timeout_s=config.engine_start_timeout_s)
        client._on_death = supervisor.on_death
        metrics = ServerMetrics(lambda: client.stats, lambda: client.num_pending,
                                lambda: (client.healthy, client.restarts))
        executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="flashinfra-tokenize")
        try:
            try:
                info = await client.start(config.engine_start_timeout_s)
            except EngineDeadError as exc:
                # One clear line (serve prints it) instead of the lifespan's tracebacks.
                logger.debug("engine start failed: %s", exc)
                outcome.error = str(exc).splitlines()[0].replace("failed to start: engine failed to start:",
                                                                 "failed to start:")
                outcome.exit_code = 2 if "failed to start" in str(exc) else 1
                raise
            if config.startup_info is not None:
                logger.info("serving:\n  %s", "\n  ".join(config.startup_info(info)))
            app.state.server = ServerState(
                client=client, tokenizer=tokenizer, model_name=config.served_model_name or info.model_name,
                max_model_len=info.max_model_len, metrics=metrics, executor=executor,
                vocab_size=info.vocab_size, media=config.media)
            app.state.generation_defaults = load_generation_defaults(config.model_path)
            lag_watch = asyncio.create_task(metrics.watch_event_loop(), name="event-loop-lag")
            try:
                yield
            finally:
                lag_watch.cancel()
        finally:
            await supervisor.stop()
            await client.shutdown()
            executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="flashinfra", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    install_disagg_routes(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)

    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    @app.get("/health")
    async def health(request: Request):
        state: ServerState = request.app.state.server
        if not state.client.healthy:
            return _unavailable(state)
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics(request: Request):
        state: ServerState = request.app.state.server
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state: ServerState = request.app.state.server
        if not state.client.healthy:
            return _unavailable(state)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "flashinfra", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.monotonic()
        state: ServerState = request.app.state.server
        _check_model(state, body.model)
        prompts, echo_texts = [], {}
        for prompt in body.prompts():
            ids = await tokenize(state, prompt) if isinstance(prompt, str) else list(prompt)
            prompts.append(ids)
        max_tokens = [check_prompt(state, ids, body.max_tokens, 16) for ids in prompts]
        defaults = request.app.state.generation_defaults
        grammar = response_grammar(body.response_format, body.guided_regex, body.guided_choice)
        sampling = [msgspec.structs.replace(apply_defaults(body.sampling_params(mt, body.num_logprobs), defaults,
                                                           body.model_fields_set), grammar=grammar)
                    for mt in max_tokens]
        request_id = new_request_id("cmpl")
        choices = make_choices(state, request_id, prompts, sampling, body.n, body.stop_strings,
                               body.include_stop_str_in_output, body.skip_special_tokens)
        if body.echo:
            raw = body.prompts()
            echo_texts = {c.index: (raw[c.index // body.n] if isinstance(raw[c.index // body.n], str)
                                    else state.tokenizer.decode(c.prompt_ids)) for c in choices}
        attach_transfer(choices, body.kv_transfer_params)
        fmt = CompletionFormatter(request_id, body.model, state.tokenizer, body.logprobs is not None, echo_texts,
                                  body.return_token_ids)
        queue = await submit(state, choices)
        return await _respond(state, request, choices, queue, fmt, body.stream, body.include_usage, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        state: ServerState = request.app.state.server
        _check_model(state, body.model)
        chat = await prepare_chat(state, body, request.app.state.generation_defaults)
        request_id = new_request_id("chatcmpl")
        choices = make_choices(state, request_id, [chat.prompt_ids], [chat.sampling], body.n, body.stop_strings,
                               body.include_stop_str_in_output, body.skip_special_tokens,
                               decoder=MarkerDecoder(state.tokenizer))
        for c in choices:
            c.mm_items = chat.mm_items
        attach_transfer(choices, body.kv_transfer_params)
        check_embeddable(state, choices)
        fmt = ChatFormatter(request_id, body.model, state.tokenizer, body.logprobs, len(choices),
                            body.return_token_ids, think_open=chat.think_open, tools=chat.tools,
                            tools_enabled=chat.tools_enabled)
        queue = await submit(state, choices)
        return await _respond(state, request, choices, queue, fmt, body.stream, body.include_usage, arrival)

    return app


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on ``/v1/`` routes. Plain ASGI (not ``BaseHTTPMiddleware``) so
    that streaming responses and client-disconnect detection pass through untouched."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self._key):
                response = error_response(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _unavailable(state: ServerState):
    reason = state.client.dead_reason or "the engine is not running"
    return error_response(503, f"{ENGINE_UNAVAILABLE}{reason}", code="engine_unavailable",
                          headers={"Retry-After": "5"})


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       "model", code="model_not_found")


async def _respond(state: ServerState, request: Request, choices: list[Choice], queue, fmt: CompletionFormatter,
                   stream: bool, include_usage: bool, arrival: float):
    def cleanup() -> None:
        # Runs even if the stream was cancelled before its first chunk: nothing stays in the engine.
        state.client.abort_soon([c.request_id for c in choices if c.finish_reason is None])

    if stream:
        return StreamingResponse(_stream(state, request, choices, queue, fmt, include_usage, arrival),
                                 media_type="text/event-stream", background=BackgroundTask(cleanup))
    try:
        async with contextlib.aclosing(run_choices(state, request, choices, queue, arrival)) as events:
            async for batch in events:
                for event in batch:
                    fmt.add(event)
    finally:
        cleanup()
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        if (failed.error or "").startswith(ENGINE_UNAVAILABLE):
            return error_response(503, failed.error, code="engine_unavailable", headers={"Retry-After": "5"})
        return error_response(500, f"generation failed: {failed.error}", code="engine_error")
    if any(c.finish_reason is None for c in choices):
        return Response(status_code=499)  # the client went away; nobody reads this
    return JSONResponse(fmt.final(choices))


async def _stream(state: ServerState, request: Request, choices: list[Choice], queue, fmt: CompletionFormatter,
                  include_usage: bool, arrival: float) -> AsyncIterator[str]:
    def with_usage(chunk: dict) -> dict:
        if include_usage:
            chunk["usage"] = None
        return chunk

    for chunk in fmt.stream_start():
        yield sse(with_usage(chunk))
    async with contextlib.aclosing(run_choices(state, request, choices, queue, arrival)) as events:
        async for batch in events:
            frames = []
            for event in batch:
                if event.choice.finish_reason == "error":
                    if event.text:  # tokens that arrived before the failure, merged into its event
                        frames.append(sse(with_usage(fmt.chunk(dataclasses.replace(event, finish_reason=None)))))
                    error = event.choice.error or ""
                    if error.startswith(ENGINE_UNAVAILABLE):
                        frames.append(sse(error_body(503, error, code="engine_unavailable")))
                    else:
                        frames.append(sse(error_body(500, f"generation failed: {error}", code="engine_error")))
                    yield "".join(frames)
                    return
                if event.text or event.finish_reason is not None or fmt.want_logprobs or fmt.want_token_ids:
                    frames.append(sse(with_usage(fmt.chunk(event))))
            if frames:  # one write for everything this wake-up produced
                yield "".join(frames)
    yield (sse(fmt.usage_chunk(choices)) if include_usage else "") + sse("[DONE]")
