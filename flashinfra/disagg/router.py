"""``flashinfra router``: an OpenAI-compatible front end over prefill-role and decode-role servers.

Each completion or chat request goes to the prefill server and the decode server with the fewest requests
in flight, at once: the prefill server gets it as an ``export`` (one output token, its cache sent to the
decode engine's transfer address), the decode server as an ``import`` of the same transfer id, and the
decode server's answer (streamed or not) is the client's. Whichever side fails first decides the answer: an
OpenAI error body (or, once a stream has started, an SSE error event), never a hang; a decode server that
dies mid-stream ends the stream with an error at once.

At start-up the router asks every server for ``/disagg/info`` and refuses to start unless each has the
role it was given and every prefill engine's cache layout matches every decode engine's (the message names
both engines and the differences). Listens on 127.0.0.1 by default.
"""

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from dataclasses import dataclass

ROUTED = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Backend:
    url: str
    role: str
    transfer_address: str = ""
    layout: dict | None = None
    model: str = ""
    in_flight: int = 0


def _error(status: int, message: str, code: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def discover(client, backends: list[Backend], timeout_s: float) -> None:
    """Fill in each backend's info (waiting up to ``timeout_s`` for it to answer); ``ValueError`` when a role
    or a cache layout does not fit."""
    from flashinfra.disagg.layout import CacheLayout, check_compatible

    deadline = time.monotonic() + timeout_s
    for b in backends:
        while True:
            try:
                r = await client.get(f"{b.url}/disagg/info", timeout=5.0)
                if r.status_code == 200:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise ValueError(f"{b.url} did not answer /disagg/info within {timeout_s:g} s")
            await asyncio.sleep(0.2)
        info = r.json()
        if info["role"] != b.role:
            raise ValueError(f"{b.url} is a {info['role']!r} server, given as --{b.role}")
        b.transfer_address, b.layout, b.model = info["transfer_address"], info["cache_layout"], info["model"]
    import msgspec

    for p in (b for b in backends if b.role == "prefill"):
        for d in (b for b in backends if b.role == "decode"):
            mine = msgspec.convert({**p.layout, "name": f"prefill {p.url}"}, CacheLayout)
            theirs = msgspec.convert({**d.layout, "name": f"decode {d.url}"}, CacheLayout)
            check_compatible(mine, theirs)


def create_router(prefill: list[str], decode: list[str], connect_timeout_s: float = 120.0,
                  request_timeout_s: float = 600.0, startup_errors: list[str] | None = None):
    """The router app; a start-up refusal's message is appended to ``startup_errors`` (then raised)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    backends = [Backend(u.rstrip("/"), "prefill") for u in prefill] + [Backend(u.rstrip("/"), "decode") for u in decode]
    by_role = {role: [b for b in backends if b.role == role] for role in ("prefill", "decode")}

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

    def pick(role: str) -> Backend:
        return min(by_role[role], key=lambda b: b.in_flight)

    async def call_prefill(client, p: Backend, path: str, body: dict) -> tuple[int, dict]:
        p.in_flight += 1
        try:
            r = await client.post(p.url + path, json=body)
            return r.status_code, r.json()
        except Exception as e:  # noqa: BLE001 - reported as the request's error
            return 502, _error(502, f"the prefill server at {p.url} failed: {type(e).__name__}: {e}",
                               "prefill_unavailable")
        finally:
            p.in_flight -= 1

    def prefill_failed(task: asyncio.Task) -> tuple[int, dict] | None:
        status, body = task.result()
        return None if status == 200 else (status, body)

    @app.get("/health")
    async def health():
        return Response("ok", media_type="text/plain")

    @app.get("/v1/models")
    async def models(request: Request):
        r = await request.app.state.client.get(pick("decode").url + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    async def route(path: str, request: Request):
        client = request.app.state.client
        try:
            body = await request.json()
            assert isinstance(body, dict)
        except Exception:  # noqa: BLE001
            return JSONResponse(_error(400, "the body is not a JSON object", "invalid_json"), status_code=400)
        if "kv_transfer_params" in body:
            return JSONResponse(_error(400, "kv_transfer_params is set by the router", "invalid_request"), 400)
        p, d = pick("prefill"), pick("decode")
        tid = uuid.uuid4().hex
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pbody["kv_transfer_params"] = {"role": "export", "transfer_id": tid, "peer": d.transfer_address}
        dbody = {**body, "kv_transfer_params": {"role": "import", "transfer_id": tid}}
        ptask = asyncio.create_task(call_prefill(client, p, path, pbody))
        d.in_flight += 1
        try:
            dresp = await client.send(client.build_request("POST", d.url + path, json=dbody), stream=True)
        except Exception as e:  # noqa: BLE001
            d.in_flight -= 1
            return JSONResponse(_error(503, f"the decode server at {d.url} failed: {type(e).__name__}: {e}",
                                       "decode_unavailable"), status_code=503)
        if dresp.status_code != 200 or not body.get("stream"):
            return await finish_plain(dresp, d, ptask)
        return StreamingResponse(relay(dresp, d, ptask), media_type="text/event-stream")

    async def finish_plain(dresp, d: Backend, ptask: asyncio.Task):
        read = asyncio.create_task(dresp.aread())
        try:
            done, _ = await asyncio.wait({read, ptask}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done and (failed := prefill_failed(ptask)) is not None:
                return JSONResponse(failed[1], status_code=failed[0])
            try:
                await read
            except Exception as e:  # noqa: BLE001
                return JSONResponse(_error(503, f"the decode server at {d.url} failed: {type(e).__name__}: {e}",
                                           "decode_unavailable"), status_code=503)
            if dresp.status_code != 200:
                if ptask.done() and (failed := prefill_failed(ptask)) is not None:
                    return JSONResponse(failed[1], status_code=failed[0])  # the cause, not the decode side's wait
                ptask.cancel()  # the prefill server aborts what it has not finished
            return Response(dresp.content, status_code=dresp.status_code, media_type="application/json")
        finally:
            read.cancel()
            await dresp.aclose()
            d.in_flight -= 1

    async def relay(dresp, d: Backend, ptask: asyncio.Task):
        chunks = dresp.aiter_raw().__aiter__()
        nxt = asyncio.ensure_future(chunks.__anext__())
        try:
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
                    yield _sse(_error(503, f"the decode server at {d.url} failed mid-stream: {type(e).__name__}: "
                                           f"{e}", "decode_unavailable"))
                    return
                yield chunk
                nxt = asyncio.ensure_future(chunks.__anext__())
        finally:
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
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--connect-timeout", type=float, default=120.0,
                   help="seconds to wait for every server's /disagg/info at start-up")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one backend call may take")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    errors: list[str] = []
    app = create_router(args.prefill, args.decode, args.connect_timeout, args.request_timeout, errors)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    try:
        server.run()
    except SystemExit:
        pass
    if not server.started:
        print(f"router: {errors[0] if errors else 'could not start (see the error above)'}", file=sys.stderr)
        return 2
    return 0
