"""The engine server's side of disaggregated serving (``flashinfra serve --role prefill|decode``).

A request's ``kv_transfer_params`` (set by ``flashinfra router``) become one engine ``TransferParams`` per
choice, the transfer id suffixed with the choice index (prefill and decode servers number choices alike).
``GET /disagg/info`` tells a router the engine's role, where a decode engine receives request states, and
the engine's cache layout, which the router compares across engines before it routes anything.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from flashinfra.engine.sched.messages import TransferParams
from flashinfra.server.errors import error_response


def attach_transfer(choices: list, params) -> None:
    """Give every choice its ``TransferParams`` (nothing when ``params`` is None)."""
    if params is None:
        return
    for c in choices:
        c.transfer = TransferParams(f"{params.transfer_id}-{c.index}", params.role, params.peer)


def install_disagg_routes(app: FastAPI) -> None:
    @app.get("/disagg/info")
    async def disagg_info(request: Request):
        state = getattr(request.app.state, "server", None)
        info = None if state is None else state.client.info
        if info is None or not state.client.healthy:
            return error_response(503, "the engine is not running", code="engine_unavailable")
        return {"role": info.role, "transfer_address": info.transfer_address, "cache_layout": info.cache_layout,
                "model": state.model_name, "max_model_len": info.max_model_len}
