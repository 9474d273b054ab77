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
    engine_failure: str = option(
        "restart", "when the engine process dies: restart it (in-flight requests get 503, new ones 503 until it "
        "is ready; bounded retries with backoff, then exit 3) or exit (code 3, for a supervisor to restart)",
        choices=("restart", "exit"))
    engine_restart_attempts: int = option(3, "engine restarts tried per failure (backoff 1 s, 2 s, 4 s, ...)",
                                          min=1)
    max_body_size: int = option(8 * 1024 * 1024, "largest request body in bytes; larger ones get 413", min=1)

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


def _bind(host: str, port: int):
    """The listening socket, bound before the model loads so that a busy port fails at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _startup_lines(engine_config: EngineConfig, model_path, name: str, opts: ServeOptions, info) -> list[str]:
    import resource

    cfg = engine_config.resolved() if hasattr(engine_config, "resolved") else engine_config
    lines = [f"model: {name} ({model_path})",
             f"device: {getattr(cfg, 'device', '?')}, dtype: {getattr(cfg, 'dtype', '?')}"]
    layout = {k: getattr(cfg, k) for k in ("tensor_parallel_size", "context_parallel_size", "pipeline_parallel_size",
                                           "data_parallel_size")
              if hasattr(cfg, k)}
    if layout:
        lines.append("parallel: " + ", ".join(f"{k}={v}" for k, v in layout.items()))
    ctx = f"context length: {info.max_model_len} tokens"
    asked = engine_config.max_model_len
    if asked is not None and asked > info.max_model_len:
        ctx += (f" (--max-model-len {asked} lowered to what the model supports and the cache holds: "
                f"{info.num_blocks} blocks x {info.block_size} tokens)")
    lines.append(ctx)
    lines.append(f"cache: {info.num_blocks} blocks of {info.block_size} tokens, {info.max_num_seqs} sequence slots; "
                 f"{_size(info.cache_bytes)} in all, {_size(info.cache_bytes_per_token)} per token, "
                 f"{_size(info.state_bytes_per_seq)} of state per request")
    if info.role in ("prefill", "decode"):
        where = f", received at {info.transfer_address}" if info.role == "decode" else ""
        lines.append(f"role: {info.role}; request states move by --transfer-backend {info.transfer_backend}{where}")
    if info.vision == "tower":
        lines.append("images: the vision tower is loaded")
    elif info.vision == "encoder":
        lines.append(f"images: embedded by the encode engine at {engine_config.encoder_address} (or the one a "
                     f"request names); no vision tower loaded")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    lines.append(f"server process memory: {rss_mb:.0f} MiB peak RSS")
    lines.append(f"listening on http://{opts.host}:{opts.port}; engine failure policy: {opts.engine_failure}")
    return lines


def run(args: argparse.Namespace) -> int:
    import logging
    import multiprocessing
    import sys
    from dataclasses import replace
    from pathlib import Path

    import msgspec
    import uvicorn

    from flashinfra import env
    from flashinfra.engine.config import from_args
    from flashinfra.server.app import ServerConfig, create_app
    from flashinfra.server.supervisor import ServerOutcome

    try:
        engine_config = EngineConfig.from_args(args)
        opts = from_args(ServeOptions, args)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if engine_config.model is None:
        from flashinfra.model.factory import default_model_dir

        model_path = default_model_dir()
        engine_config = replace(engine_config, model=str(model_path))
    model_path = Path(engine_config.model)
    name = opts.served_model_name or args.model or "default"
    if not (model_path / "config.json").is_file():
        print(f"serve: {model_path} is not a checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    from flashinfra.parallel.engine import serving_rank

    try:
        engine_config = serving_rank(engine_config)
        if engine_config is None:  # this process ran ranks of a parallel engine; rank 0 serves
            return 0
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    try:
        sock = _bind(opts.host, opts.port)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine_config.role == "encode":
        from flashinfra.server.disagg import run_encode_server

        return run_encode_server(engine_config, sock, name, opts.log_level)

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
    outcome = ServerOutcome()
    config = ServerConfig(model_path=model_path, launcher=launch, served_model_name=name,
                          api_key=opts.api_key or env.server_api_key(), max_pending=opts.max_pending,
                          media=media, engine_failure=opts.engine_failure,
                          engine_restart_attempts=opts.engine_restart_attempts, max_body_bytes=opts.max_body_size,
                          outcome=outcome,
                          startup_info=lambda info: _startup_lines(engine_config, model_path, name, opts, info))

    class _QuietStartFailure(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return outcome.error is None  # the reason is printed once below, without tracebacks

    for logger_name in ("uvicorn.error", "uvicorn"):
        logging.getLogger(logger_name).addFilter(_QuietStartFailure())
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level=opts.log_level,
                                           timeout_graceful_shutdown=opts.shutdown_timeout,
                                           access_log=opts.log_level == "debug"))
    outcome.request_exit = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits when the lifespan start-up failed
        if outcome.error is None:
            raise
        del exc
    finally:
        sock.close()
    if outcome.error is not None:
        print(f"serve: {outcome.error}", file=sys.stderr)
        return outcome.exit_code or 1
    if outcome.exit_code == 0 and not server.started:
        return 1
    return outcome.exit_code
