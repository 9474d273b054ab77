"""``flashinfra router``: an OpenAI-compatible front end over prefill-role and decode-role servers.

Each completion or chat request goes to the prefill server and the decode server with the fewest requests
in flight, at once: the prefill server gets it as an ``export`` (one output token, its cache sent to the
decode engine's transfer address), the decode server as an ``import`` of the same transfer id, and the
decode server's answer (streamed or not) is the client's. Whichever side fails first decides the answer: an
OpenAI error body (or, once a stream has started, an SSE error event), never a hang; a decode server that
dies mid-stream ends the stream with an error at once. With encode servers (``--encode``), a request with
images or videos also names the encode server with the fewest requests in flight to the prefill server,
whose engine takes the embeddings from it.

An engine that refuses a request before any of its output reached the client (unreachable, a 5xx or 429
answer, a dropped connection, a prefill that failed) is left out and the request runs again, under a new
transfer id, on the engines not yet tried; a client error (4xx) is answered as it is. A stream's status is
sent with its first event, so everything up to that event can be retried.

``GET /metrics`` (Prometheus text): requests in flight, requests sent and failures per engine, retries.

At start-up the router asks every server for ``/disagg/info`` and refuses to start unless each has the
role it was given and every prefill engine's cache layout and transfer backend match every decode engine's
(the message names both engines and the differences). Listens on 127.0.0.1 by default.
"""

import argparse
import asyncio
import contextlib
import json
import sys
import uuid

from flashinfra.server.errors import error_body
from flashinfra.server.router_engines import Backend, discover

ROUTED = ("/v1/completions", "/v1/chat/completions")


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def _has_media(body: dict) -> bool:
    """Whether a chat request carries images or videos (the parts an encode engine is for)."""
    media = ("image_url", "video_url")
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(part, dict) and part.get("type") in media for part in m["content"])
               for m in body.get("messages") or [])


class _Answer(Exception):
    """A failure every engine would answer alike (a client error): the client gets it as it is."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body)
        self.status, self.body = status, body


class _Refused(Exception):
    """An attempt failed before any output reached the client; ``blame``: the engines left out next time."""

    def __init__(self, blame: list[Backend], status: int, body: dict) -> None:
        super().__init__(body)
        self.blame, self.status, self.body = blame, status, body


def _retryable(status: int) -> bool:
    return status >= 500 or status == 429


class _Collector:
    """The router's figures, read at scrape time."""

    def __init__(self, backends: list[Backend], retries: list[int]) -> None:
        self.backends, self.retries = backends, retries

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["engine", "role"]
        in_flight = GaugeMetricFamily("flashinfra_router_requests_in_flight", "Requests an engine is serving now",
                                      labels=labels)
        total = CounterMetricFamily("flashinfra_router_requests", "Requests sent to an engine", labels=labels)
        failures = CounterMetricFamily("flashinfra_router_failures", "Requests an engine failed or refused",
                                       labels=labels)
        for b in self.backends:
            in_flight.add_metric([b.url, b.role], b.in_flight)
            total.add_metric([b.url, b.role], b.num_requests)
            failures.add_metric([b.url, b.role], b.num_failures)
        retries = CounterMetricFamily("flashinfra_router_retries", "Requests run again on other engines")
        retries.add_metric([], self.retries[0])
        yield from (in_flight, total, failures, retries)


def create_router(prefill: list[str], decode: list[str], connect_timeout_s: float = 120.0,
                  request_timeout_s: float = 600.0, startup_errors: list[str] | None = None,
                  encode: list[str] | None = None):
    """The router app; a start-up refusal's message is appended to ``startup_errors`` (then raised)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, generate_latest

    backends = [Backend(u.rstrip("/"), role) for role, urls in (("prefill", prefill), ("decode", decode),
                                                                 ("encode", encode or [])) for u in urls]
    by_role = {role: [b for b in backends if b.role == role] for role in ("prefill", "decode", "encode")}
    retries = [0]
    registry = CollectorRegistry()
    registry.register(_Collector(backends, retries))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=10.0), limits=limits) as client:
            try:
                await discover(client, backends, connect_timeout_s)
            except ValueError as e:
                if startup_errors is not None:
                    startup_errors.append(str(e))
                raise
            app.state.client = client
            yield

    app = FastAPI(title="flashinfra router", lifespan=lifespan)

    def pick(role: str, tried: set[str] = frozenset()) -> Backend | None:
        return min((b for b in by_role[role] if b.url not in tried), key=lambda b: b.in_flight, default=None)

    async def call_prefill(client, p: Backend, path: str, body: dict, e: Backend | None) -> tuple[int, dict]:
        """The prefill server's answer; the encode server ``e`` counts the request in flight meanwhile."""
        for b in (p, e) if e is not None else (p,):
            b.in_flight += 1
            b.num_requests += 1
        try:
            r = await client.post(p.url + path, json=body)
            status, answer = r.status_code, r.json()
        except Exception as exc:  # noqa: BLE001 - reported as the request's error
            status, answer = 502, error_body(
                502, f"the prefill server at {p.url} failed: {type(exc).__name__}: {exc}", code="prefill_unavailable")
        finally:
            p.in_flight -= 1
            if e is not None:
                e.in_flight -= 1
        p.num_failures += status != 200
        return status, answer

    def prefill_failed(task: asyncio.Task) -> tuple[int, dict] | None:
        status, body = task.result()
        return None if status == 200 else (status, body)

    def refused(failed: tuple[int, dict], p: Backend, d: Backend, decode_refused: bool = False,
                e: Backend | None = None) -> Exception:
        """What a prefill failure before any output means: a client error is answered as it is; a failed
        send of the cache blames the decode engine (its messages name it), anything else the prefill one
        (and the decode one too when it refused as well)."""
        status, answer = failed
        if not _retryable(status):
            return _Answer(status, answer)
        message = str((answer.get("error") or {}).get("message", "")) if isinstance(answer, dict) else ""
        blame = ([d] if "decode engine" in message else [e] if e is not None and "encode engine" in message
                 else [p, d] if decode_refused else [p])
        return _Refused(blame, status, answer)

    def decode_error(d: Backend, e: Exception, status: int = 503) -> dict:
        return error_body(status, f"the decode server at {d.url} failed: {type(e).__name__}: {e}",
                          code="decode_unavailable")

    @app.get("/health")
    async def health():
        return Response("ok", media_type="text/plain")

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        r = await request.app.state.client.get(pick("decode").url + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    async def route(path: str, request: Request):
        try:
            body = await request.json()
            assert isinstance(body, dict)
        except Exception:  # noqa: BLE001
            return JSONResponse(error_body(400, "the body is not a JSON object", code="invalid_json"), status_code=400)
        if "kv_transfer_params" in body:
            return JSONResponse(error_body(400, "kv_transfer_params is set by the router", code="invalid_request"), 400)
        tried: set[str] = set()
        media = by_role["encode"] and _has_media(body)
        while True:
            p, d, e = pick("prefill", tried), pick("decode", tried), pick("encode", tried) if media else None
            try:
                return await attempt(request.app.state.client, path, body, p, d, e)
            except _Refused as refusal:
                for b in refusal.blame:
                    b.num_failures += b.role != "prefill"  # a prefill failure is counted in call_prefill
                    tried.add(b.url)
                if any(pick(b.role, tried) is None for b in refusal.blame):
                    return JSONResponse(refusal.body, status_code=refusal.status)
                retries[0] += 1

    async def attempt(client, path: str, body: dict, p: Backend, d: Backend, e: Backend | None):
        """One try on ``p`` and ``d`` (and ``e`` for the images): the client's response, or ``_Refused`` before
        any output was sent."""
        tid = uuid.uuid4().hex
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pbody["kv_transfer_params"] = {"role": "export", "transfer_id": tid, "peer": d.transfer_address}
        if e is not None:
            pbody["kv_transfer_params"]["encoder"] = e.transfer_address
        dbody = {**body, "kv_transfer_params": {"role": "import", "transfer_id": tid}}
        ptask = asyncio.create_task(call_prefill(client, p, path, pbody, e))
        d.in_flight += 1
        d.num_requests += 1
        dresp = None
        send = asyncio.create_task(client.send(client.build_request("POST", d.url + path, json=dbody), stream=True))
        try:
            # a decode server answers a plain request only when it is done: watch the prefill call meanwhile
            done, _ = await asyncio.wait({send, ptask}, return_when=asyncio.FIRST_COMPLETED)
            if send not in done and (failed := prefill_failed(ptask)) is not None:
                raise refused(failed, p, d, e=e)
            try:
                dresp = await send
            except Exception as exc:  # noqa: BLE001
                raise _Refused([d], 503, decode_error(d, exc)) from None
            if dresp.status_code != 200 or not body.get("stream"):
                response = await finish_plain(dresp, d, p, e, ptask)
            else:
                chunks = dresp.aiter_raw().__aiter__()
                first = await next_chunk(chunks, d, p, e, ptask)
                response = StreamingResponse(relay(first, chunks, dresp, d, ptask), media_type="text/event-stream")
        except BaseException:
            ptask.cancel()  # the prefill server aborts what it has not finished
            send.cancel()  # and the decode server the import it waits for
            if dresp is not None:
                await dresp.aclose()
            d.in_flight -= 1
            raise
        if not isinstance(response, StreamingResponse):
            await dresp.aclose()
            d.in_flight -= 1
        return response

    async def finish_plain(dresp, d: Backend, p: Backend, e: Backend | None, ptask: asyncio.Task):
        read = asyncio.create_task(dresp.aread())
        try:
            done, _ = await asyncio.wait({read, ptask}, return_when=asyncio.FIRST_COMPLETED)
            decode_refused = _retryable(dresp.status_code)
            if read not in done and (failed := prefill_failed(ptask)) is not None:
                raise refused(failed, p, d, decode_refused, e)
            try:
                await read
            except Exception as exc:  # noqa: BLE001
                raise _Refused([d], 503, decode_error(d, exc)) from None
            if dresp.status_code != 200:
                if ptask.done() and (failed := prefill_failed(ptask)) is not None:
                    # the cause, not the decode side's wait
                    raise refused(failed, p, d, decode_refused, e)
                if decode_refused:
                    raise _Refused([d], dresp.status_code, dresp.json())
                ptask.cancel()
            return Response(dresp.content, status_code=dresp.status_code, media_type="application/json")
        except _Answer as a:
            return JSONResponse(a.body, status_code=a.status)
        finally:
            read.cancel()

    async def next_chunk(chunks, d: Backend, p: Backend, e: Backend | None, ptask: asyncio.Task) -> bytes:
        """A stream's first chunk, or ``_Refused`` when either side fails before it."""
        nxt = asyncio.ensure_future(chunks.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({nxt} if ptask.done() else {nxt, ptask},
                                             return_when=asyncio.FIRST_COMPLETED)
                if ptask in done and (failed := prefill_failed(ptask)) is not None:
                    if not _retryable(failed[0]):
                        return _sse(failed[1])
                    raise refused(failed, p, d, e=e)
                if nxt in done:
                    try:
                        return nxt.result()
                    except StopAsyncIteration:
                        return b""
                    except Exception as exc:  # noqa: BLE001
                        raise _Refused([d], 503, decode_error(d, exc)) from None
        finally:
            nxt.cancel()

    async def relay(first: bytes, chunks, dresp, d: Backend, ptask: asyncio.Task):
        nxt = None
        try:
            yield first
            if not first or first.startswith(b"data: {\"error\""):
                return
            nxt = asyncio.ensure_future(chunks.__anext__())
            while True:
                waits = {nxt} if ptask.done() else {nxt, ptask}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if ptask in done and (failed := prefill_failed(ptask)) is not None:
                    yield _sse(failed[1])
                    return
                if nxt not in done:
                    continue
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    return
                except Exception as e:  # noqa: BLE001 - the decode server went away mid-stream
                    d.num_failures += 1
                    yield _sse(error_body(503, f"the decode server at {d.url} failed mid-stream: {type(e).__name__}: "
                                           f"{e}", code="decode_unavailable"))
                    return
                yield chunk
                nxt = asyncio.ensure_future(chunks.__anext__())
        finally:
            if nxt is not None:
                nxt.cancel()
            await dresp.aclose()
            d.in_flight -= 1

    def endpoint_for(path: str):
        async def endpoint(request: Request):
            return await route(path, request)
        return endpoint

    for path in ROUTED:
        app.add_api_route(path, endpoint_for(path), methods=["POST"])
    return app


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="OpenAI-compatible front end over prefill and decode servers")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill-role servers")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode-role servers")
    p.add_argument("--encode", nargs="+", default=[], metavar="URL",
                   help="encode-role servers, for requests with images or videos")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--connect-timeout", type=float, default=120.0,
                   help="seconds to wait for every server's /disagg/info at start-up")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one backend call may take")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="the router's log threshold")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    errors: list[str] = []
    app = create_router(args.prefill, args.decode, args.connect_timeout, args.request_timeout, errors, args.encode)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    try:
        server.run()
    except SystemExit:
        pass
    if not server.started:
        print(f"router: {errors[0] if errors else 'could not start (see the error above)'}", file=sys.stderr)
        return 2
    return 0
