"""``flashinfra serve``: the OpenAI-compatible HTTP server (with its engine process).

Registration is torch-free; ``run`` resolves the model directory (the built-in default model when no
``--model`` is given), builds the engine's ``EngineConfig`` and runs uvicorn, which drains in-flight
requests on SIGINT/SIGTERM before the engine is stopped.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API over HTTP")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in default model)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model argument, or 'default')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ routes (default: $FLASHINFRA_API_KEY)")
    p.add_argument("--max-pending", type=int, default=1024,
                   help="in-flight sub-requests the server accepts before answering 429")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="paged cache blocks (default: from memory)")
    p.add_argument("--kv-cache-memory", default=None, help="cache memory budget, e.g. 2GiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-prefill-chunk", type=int, default=0,
                   help="most prompt tokens one request takes in a step (0: the whole token budget)")
    p.add_argument("--prefix-cache-slots", type=int, default=None,
                   help="KDA state checkpoints kept for prefix caching (default: max-num-seqs; 0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--events-path", default=None, help="write the engine's runtime events (JSONL) here")
    p.add_argument("--gil-probe-ms", type=float, default=None,
                   help="report GIL stalls of the engine process longer than this, as gil_stall events")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--enable-vision", action="store_true",
                   help="load the vision tower and accept image_url/video_url parts (off: text only)")
    p.add_argument("--allowed-media-hosts", default="",
                   help="comma-separated hosts whose http(s) image/video URLs may be fetched (default: none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def engine_config_from_args(args: argparse.Namespace, model_path: str):
    from flashinfra.engine.config import EngineConfig, parse_memory

    return EngineConfig(
        model=model_path, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=parse_memory(args.kv_cache_memory) if args.kv_cache_memory else None,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, max_prefill_chunk=args.max_prefill_chunk,
        prefix_cache_slots=args.prefix_cache_slots, seed=args.seed, events_path=args.events_path,
        gil_probe_ms=args.gil_probe_ms, enable_vision=args.enable_vision,
        allowed_media_hosts=args.allowed_media_hosts)


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
    from pathlib import Path

    import msgspec
    import uvicorn

    from flashinfra import env
    from flashinfra.server.app import ServerConfig, create_app

    if args.model is None:
        from flashinfra.model.factory import default_model_dir

        model_path = default_model_dir()
        name = args.served_model_name or "default"
    else:
        model_path = Path(args.model)
        name = args.served_model_name or args.model
    if not (model_path / "config.json").is_file():
        raise SystemExit(f"serve: {model_path} is not a checkpoint directory (no config.json)")
    try:
        engine_config = engine_config_from_args(args, str(model_path))
    except ValueError as exc:
        raise SystemExit(f"serve: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

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
                          api_key=args.api_key or env.server_api_key(), max_pending=args.max_pending, media=media)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.log_level == "debug")
    return 0
