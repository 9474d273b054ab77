"""The API process's own cost: ``flashinfra serve``'s app in front of an engine that computes nothing.

The echo engine speaks the engine process's protocol (``EngineReady``, then one ``EngineOutputs`` per
step with a token for every running request) and sleeps ``--step-ms`` per step in place of the model, so
the serving benchmark measures only what the HTTP server, the engine client, detokenisation, stop strings
and SSE framing cost. ``--profile FILE`` runs the server under cProfile and writes its stats there.

    python bench/server_overhead.py --concurrency 64 --num-prompts 128 --output bench/results/server_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# Token ids the echo engine cycles through: ordinary pieces of the built-in tokenizer, no special tokens.
_FIRST_TOKEN, _LAST_TOKEN = 300, 3000


def run_echo_engine(input_address: str, output_address: str, step_s: float, max_model_len: int,
                    vocab_size: int) -> None:
    """Engine process entry point: one token per running request per step, ``step_s`` per step."""
    import zmq

    from flashinfra.engine.sched.messages import (AbortRequest, EngineOutputs, EngineReady, EngineRequests,
                                                  EngineStats, RequestOutput, Shutdown, decode_server_message,
                                                  encode)

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_address)
    out = ctx.socket(zmq.PUSH)
    out.connect(output_address)
    out.send(encode(EngineReady("echo", max_model_len, vocab_size, [], 0, 16, 1024)))
    running: dict[str, list[int]] = {}  # request id -> [tokens left, next token id, prompt tokens]
    span = _LAST_TOKEN - _FIRST_TOKEN
    while True:
        while inp.poll(0 if running else 50):
            msg = decode_server_message(inp.recv())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequest):
                for rid in msg.request_ids:
                    running.pop(rid, None)
            else:
                for req in msg.with_media() if isinstance(msg, EngineRequests) else [msg]:
                    running[req.request_id] = [req.sampling.max_tokens, req.prompt_token_ids[-1] % span,
                                               len(req.prompt_token_ids)]
        if not running:
            continue
        time.sleep(step_s)
        outputs = []
        for rid, entry in list(running.items()):
            entry[0] -= 1
            entry[1] = (entry[1] + 7) % span
            done = entry[0] == 0
            outputs.append(RequestOutput(rid, [_FIRST_TOKEN + entry[1]], None, done, "length" if done else None,
                                         num_prompt_tokens=entry[2]))
            if done:
                del running[rid]
        out.send(encode(EngineOutputs(outputs, EngineStats(0, len(running), 0.0, 0))))


def serve(port: int, step_s: float, profile: str | None) -> None:
    """Run the app on 127.0.0.1:``port`` with the echo engine (the process ends on SIGTERM)."""
    import signal

    import uvicorn

    from flashinfra.model.factory import default_model_dir
    from flashinfra.server.app import ServerConfig, create_app

    def launch(input_addr: str, output_addr: str):
        proc = multiprocessing.get_context("spawn").Process(
            target=run_echo_engine, args=(input_addr, output_addr, step_s, 1 << 20, 4096), daemon=True)
        proc.start()
        return proc

    config = ServerConfig(model_path=default_model_dir(), launcher=launch, served_model_name="echo",
                          api_key=None, max_pending=4096)
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    if profile is None:
        server.run()
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        server.run()
    finally:
        profiler.disable()
        profiler.dump_stats(profile)


def measure(concurrency: int, num_prompts: int, input_len: int, output_len: int, step_ms: float,
            port: int = 8790, profile: str | None = None) -> dict:
    """Start the echo server, run the serving benchmark against it, stop it; return the report."""
    from serve_runs import bench, repo_env, wait_healthy

    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--step-ms", str(step_ms)]
    if profile:
        cmd += ["--profile", profile]
    server = subprocess.Popen(cmd, env=repo_env())
    try:
        wait_healthy(port, server, 120.0)
        return bench(port, concurrency, num_prompts, input_len, output_len)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help="only run the echo server (used by the benchmark)")
    p.add_argument("--port", type=int, default=8790)
    p.add_argument("--step-ms", type=float, default=1.0, help="the echo engine's time per step")
    p.add_argument("--profile", default=None, help="write the server's cProfile stats here")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output", default=None, help="write the JSON report here")
    args = p.parse_args()
    if args.serve:
        serve(args.port, args.step_ms / 1000.0, args.profile)
        return
    from flashinfra.feedback.timing import header, write_results

    report = header()
    report["step_ms"] = args.step_ms
    report["serve"] = measure(args.concurrency, args.num_prompts, args.input_len, args.output_len, args.step_ms,
                              args.port, args.profile)
    print(json.dumps(report, indent=2))
    if args.output:
        out = Path(args.output)
        write_results(out.stem, report, directory=out.parent)


if __name__ == "__main__":
    main()
