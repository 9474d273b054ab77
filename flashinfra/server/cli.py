"""``flashinfra serve``: the OpenAI-compatible HTTP server (with its engine process).

The flags are generated from two configs: ``EngineConfig`` (the engine's, shared with ``generate``) and
``ServeOptions`` (the HTTP server's own). Registration is torch-free; ``run`` resolves the model directory
(the built-in default model when no ``--model`` is given) and runs uvicorn, which drains in-flight
requests on SIGINT/SIGTERM before the engine is stopped.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from flashinfra.engine.config import EngineConfig, add_config_args, check_fields, option


@dataclass(frozen=True)
class ServeOptions:
    """The HTTP server's own settings (the engine's are ``EngineConfig``'s); flags generated like them."""

    served_model_name: str | None = option(
        None, "the model name clients send (default: the --model argument, or 'default')", metavar="NAME")
    host: str = option("127.0.0.1", "address to listen on", metavar="HOST")
    port: int = option(8000, "port to listen on", min=1)
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on /v1/ routes (default: $FLASHINFRA_API_KEY)", metavar="KEY")
    max_pending: int = option(1024, "in-flight sub-requests the server accepts before answering 429", min=1)
    shutdown_timeout: float = option(60.0, "seconds in-flight requests get to finish on shutdown", min=0)
    log_level: str = option("info", "log level", choices=("critical", "error", "warning", "info", "debug"))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    add_config_args(p.add_argument_group("engine"), EngineConfig)
    add_config_args(p.add_argument_group("server"), ServeOptions)
    p.set_defaults(func=run)


def engine_main(config: bytes, input_addr: str, output_addr: str) -> None:
    """The engine process's entry point when the server starts it.

    The engine's lifetime belongs to the server (``Shutdown`` after draining; it also exits when its
    parent dies), so a SIGTERM or SIGINT sent to the whole process group (systemd, a terminal's Ctrl-C)
    must not kill it while the server drains in-flight requests.
    """
    import signal

    from flashinfra.engine.process import run_engine

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_engine(config, input_addr, output_addr)


def run(args: argparse.Namespace) -> int:
    import logging
    import multiprocessing
    from dataclasses import replace
    from pathlib import Path

    import msgspec
    import uvicorn

    from flashinfra import env
    from flashinfra.engine.config import from_args
    from flashinfra.server.app import ServerConfig, create_app

    try:
        engine_config = EngineConfig.from_args(args)
        opts = from_args(ServeOptions, args)
    except ValueError as exc:
        raise SystemExit(f"serve: {exc}") from None
    if engine_config.model is None:
        from flashinfra.model.factory import default_model_dir

        model_path = default_model_dir()
        engine_config = replace(engine_config, model=str(model_path))
    model_path = Path(engine_config.model)
    name = opts.served_model_name or args.model or "default"
    if not (model_path / "config.json").is_file():
        raise SystemExit(f"serve: {model_path} is not a checkpoint directory (no config.json)")
    if engine_config.tensor_parallel_size > 1 or engine_config.expert_parallel_size > 1:
        from flashinfra.parallel.engine import check_layout, run_worker_node

        try:
            check_layout(engine_config)
        except ValueError as exc:
            raise SystemExit(f"serve: {exc}") from None
        if engine_config.node_rank > 0:  # this host only runs its ranks; host 0 serves
            run_worker_node(engine_config)
            return 0
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def launch(input_addr: str, output_addr: str):
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=engine_main, args=(msgspec.msgpack.encode(engine_config), input_addr, output_addr),
                           name="flashinfra-engine", daemon=True)
        proc.start()
        return proc

    media = None
    if engine_config.enable_vision:
        from flashinfra.multimodal.inputs import MediaLimits
        from flashinfra.server.media import MediaSettings

        media = MediaSettings.for_model(model_path, MediaLimits(
            engine_config.media_max_bytes, engine_config.media_max_pixels, engine_config.media_max_frames,
            engine_config.media_max_items), engine_config.allowed_media_hosts)
    config = ServerConfig(model_path=model_path, launcher=launch, served_model_name=name,
                          api_key=opts.api_key or env.server_api_key(), max_pending=opts.max_pending,
                          media=media)
    uvicorn.run(create_app(config), host=opts.host, port=opts.port, log_level=opts.log_level,
                timeout_graceful_shutdown=opts.shutdown_timeout, access_log=opts.log_level == "debug")
    return 0
