"""The engine server's side of disaggregated serving (``flashinfra serve --role prefill|decode|encode``).

A request's ``kv_transfer_params`` (set by ``flashinfra router``) become one engine ``TransferParams`` per
choice, the transfer id suffixed with the choice index (prefill and decode servers number choices alike).
``GET /disagg/info`` tells a router the engine's role, where a decode engine receives request states, the
engine's cache layout, which the router compares across engines before it routes anything, and what makes its
image embeddings (``vision``: its tower, an encode engine, or nothing). A request with images reaching an
engine that has nothing to embed them with is answered 400 (``check_embeddable``).

``--role encode`` runs no engine process: ``run_encode_server`` loads the vision tower alone, answers
prefill engines on ``--transfer-address`` (``disagg.encode.EncodeServer``) and serves ``/health``,
``/disagg/info`` (its embedding layout) and ``/metrics`` over HTTP.
"""

from __future__ import annotations

import sys

from fastapi import FastAPI, Request

from flashinfra.engine.sched.messages import TransferParams
from flashinfra.server.errors import bad_request, error_response


def attach_transfer(choices: list, params) -> None:
    """Give every choice its ``TransferParams`` (nothing when ``params`` is None)."""
    if params is None:
        return
    for c in choices:
        c.transfer = TransferParams(f"{params.transfer_id}-{c.index}", params.role, params.peer, params.encoder)


def check_embeddable(state, choices: list) -> None:
    """A 400 for a request with images or videos that this engine cannot embed: no vision tower and no encode
    engine (a decode-role engine; it takes them only in requests whose prefill was computed elsewhere)."""
    info = state.client.info
    if info is None or info.vision:
        return
    for c in choices:
        if c.mm_items and (c.transfer is None or c.transfer.role != "import"):
            raise bad_request(f"this {info.role}-role engine has no vision tower and no encode engine: images and "
                              f"videos go to a prefill or both engine started with --enable-vision (and "
                              f"--encoder-address when an encode engine makes their embeddings)", "messages")


def install_disagg_routes(app: FastAPI) -> None:
    @app.get("/disagg/info")
    async def disagg_info(request: Request):
        state = getattr(request.app.state, "server", None)
        info = None if state is None else state.client.info
        if info is None or not state.client.healthy:
            return error_response(503, "the engine is not running", code="engine_unavailable")
        return {"role": info.role, "transfer_address": info.transfer_address, "cache_layout": info.cache_layout,
                "transfer_backend": info.transfer_backend,
                "model": state.model_name, "max_model_len": info.max_model_len, "vision": info.vision}


def create_encode_app(server, layout, name: str) -> FastAPI:
    """The HTTP face of an encode engine (``server``: its running ``EncodeServer``)."""
    import msgspec
    from fastapi.responses import PlainTextResponse

    app = FastAPI(title="flashinfra encode engine")

    @app.get("/health")
    async def health():
        return PlainTextResponse("ok")

    @app.get("/disagg/info")
    async def disagg_info():
        return {"role": "encode", "transfer_address": server.address, "cache_layout": msgspec.to_builtins(layout),
                "model": name, "max_model_len": 0}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# TYPE flashinfra_encoded_items_total counter\n"
            f"flashinfra_encoded_items_total {server.num_encoded}\n"
            "# TYPE flashinfra_encode_failures_total counter\n"
            f"flashinfra_encode_failures_total {server.num_failures}\n")

    return app


def run_encode_server(config, sock, name: str, log_level: str) -> int:
    """``flashinfra serve --role encode`` on the bound ``sock`` until stopped."""
    import uvicorn

    from flashinfra.disagg.encode import EncodeServer, embedding_layout, load_tower

    config = config.resolved()
    try:
        tower, model_config = load_tower(config.model, config.dtype, config.device)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    layout = embedding_layout(model_config.vision, model_config.text.hidden_size, next(tower.parameters()).dtype,
                              name=f"encode engine ({name})")
    server = EncodeServer(tower, layout, config.transfer_address, config.device)
    try:
        uvicorn.Server(uvicorn.Config(create_encode_app(server, layout, name), log_level=log_level)).run(sockets=[sock])
    finally:
        server.close()
        sock.close()
    return 0
