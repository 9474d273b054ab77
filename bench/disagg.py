"""Disaggregated serving against one engine, and each transport's bandwidth against the link's.

- ``serve``: ``flashinfra serve`` (role both) with the built-in model (or ``--model``), then a prefill server,
  a decode server and ``flashinfra router`` in front of them per ``--backend``; ``flashinfra bench serve``
  at each ``--concurrency`` against the single server and against the router: TTFT and TPOT, both ways.
- ``bandwidth``: one process sends request states of ``--mbytes`` (``--blocks`` cache blocks of one paged
  tensor) to another with each ``--backend``, two in flight, ``--count`` times; the rate from the first send
  to the last ack, against the link's in the same run: a copy of the same bytes from the sender's device to
  the receiver's within one process (one GPU or two: what CUDA IPC can reach), or a host memcpy (shared
  memory, the loopback).

    python bench/disagg.py --device cuda --out $OUT                    # both parts, zmq and ipc
    python bench/disagg.py --device cuda:0 --decode-device cuda:1 --out $OUT   # two GPUs
    python bench/disagg.py --parts bandwidth --device cpu --out bench/results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import torch  # noqa: E402

from flashinfra.feedback.timing import header, write_results  # noqa: E402

INPUT_LEN, OUTPUT_LEN = 1024, 128
PORT = 8840


def _num_prompts(concurrency: int) -> int:
    return max(4 * concurrency, 16)


def serve_rows(args, log_dir: Path) -> dict:
    from serve_runs import log_tail, running, sweep

    engine = ["--max-num-seqs", str(max(args.concurrency)), "--log-level", "info"]
    if args.model:
        engine += ["--model", args.model]
    prefill_on, decode_on = ["--device", args.device], ["--device", args.decode_device or args.device]
    flashinfra = [sys.executable, "-m", "flashinfra"]
    out: dict = {}
    with running([*flashinfra, "serve", "--port", str(PORT), *prefill_on, *engine], PORT, log_dir / "both.log", 600,
                 90):
        out["colocated"] = sweep(PORT, args.concurrency, _num_prompts, args.input_len, args.output_len)
    for i, backend in enumerate(args.backend):
        base = PORT + 10 * (i + 1)
        roles = ["--transfer-backend", backend, "--transfer-timeout-s", "120"]
        with ExitStack() as stack:
            stack.enter_context(running([*flashinfra, "serve", "--port", str(base + 1), *prefill_on, *engine, "--role",
                                         "prefill", *roles], base + 1, log_dir / f"prefill-{backend}.log", 600, 90))
            stack.enter_context(running([*flashinfra, "serve", "--port", str(base + 2), *decode_on, *engine, "--role",
                                         "decode",
                                         "--transfer-address", f"tcp://127.0.0.1:{base + 5}", *roles], base + 2,
                                        log_dir / f"decode-{backend}.log", 600, 90))
            stack.enter_context(running([*flashinfra, "router", "--port", str(base), "--prefill",
                                         f"http://127.0.0.1:{base + 1}", "--decode", f"http://127.0.0.1:{base + 2}"],
                                        base, log_dir / f"router-{backend}.log", 120, 30))
            out[f"disaggregated_{backend}"] = sweep(base, args.concurrency, _num_prompts, args.input_len,
                                                    args.output_len)
        out[f"decode_log_tail_{backend}"] = log_tail(log_dir / f"decode-{backend}.log")
    return out


def _cache(device: str, blocks: int, block_bytes: int):
    from flashinfra.model.cache import ModelCache

    return ModelCache(block_size=1, num_blocks=blocks, num_slots=1, indexer_keys={}, conv_state={},
                      recurrent_state={},
                      mla_latent={0: torch.zeros(blocks, 1, block_bytes, dtype=torch.uint8, device=device)})


def _classes(backend: str):
    from flashinfra.disagg import transport

    if backend == "ipc":
        from flashinfra.disagg.ipc import IpcReceiver, IpcSender

        return IpcSender, IpcReceiver
    if backend == "mooncake":
        from flashinfra.disagg.mooncake import MooncakeReceiver, MooncakeSender

        return MooncakeSender, MooncakeReceiver
    return transport.StateSender, transport.StateReceiver


def run_sender(args) -> None:
    """The sending process: ``--count`` states of every block, two in flight; prints its JSON line."""
    from flashinfra.disagg.layout import RequestPages, RequestState, describe

    cache = _cache(args.device, args.blocks, (args.mbytes << 20) // args.blocks)
    cache.mla_latent[0].random_(0, 255)
    sender_cls, _ = _classes(args.backend)
    kw = {} if args.backend == "zmq" else {"caches": cache}
    tx = sender_cls(describe(cache, "bench", "prefill"), **kw)
    blocks = list(range(args.blocks))
    pages = RequestPages(cache, blocks, None)
    sent = acked = 0
    errors, start = [], time.perf_counter()
    while acked < args.count:
        while sent < args.count and tx.num_outstanding < 2:
            tx.send(args.sender, RequestState(str(sent), args.blocks, args.blocks, 0),
                    pages)
            sent += 1
        for _, error in tx.poll():
            acked += 1
            if error:
                errors.append(error)
        time.sleep(0.0002)
    seconds = time.perf_counter() - start
    tx.close()
    print(json.dumps({"seconds": seconds, "bytes": args.count * (args.mbytes << 20), "errors": errors[:3]}))


def bandwidth_row(args, backend: str) -> dict:
    """Receive ``--count`` states from a sender process; its rate, and the receiver's copy time per state."""
    from flashinfra.disagg.layout import describe

    cache = _cache(args.decode_device or args.device, args.blocks, (args.mbytes << 20) // args.blocks)
    _, receiver_cls = _classes(backend)
    kw = {} if backend == "zmq" else {"caches": cache}
    rx = receiver_cls(describe(cache, "bench", "decode"), **kw)
    cmd = [sys.executable, __file__, "--sender", rx.address, "--backend", backend, "--device", args.device,
           "--mbytes", str(args.mbytes), "--blocks", str(args.blocks), "--count", str(args.count)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    blocks, arrived, done = list(range(args.blocks)), {}, 0
    try:
        while done < args.count:
            assert proc.poll() is None or done >= args.count, "the sender exited early"
            for arrival in rx.poll():
                if rx.reads_in_place:
                    arrived[arrival.state.request_id] = arrival
                    rx.read(arrival, cache, blocks, None)
                else:
                    rx.write(arrival, cache, blocks, None)
                    rx.ack(arrival.peer, arrival.state.request_id)
                    done += 1
            for tid, error in rx.poll_reads() if rx.reads_in_place else []:
                rx.ack(arrived.pop(tid).peer, tid, error or "")
                done += 1
            time.sleep(0.0002)
        out, _ = proc.communicate(timeout=120)
    finally:
        rx.close()
        if proc.poll() is None:
            proc.kill()
    sent = json.loads(out.strip().splitlines()[-1])
    return {"gb_s": sent["bytes"] / sent["seconds"] / 1e9, **sent, "mbytes_each": args.mbytes,
            "blocks_each": args.blocks}


def link_row(args) -> dict:
    """The same bytes copied once within this process, from the sender's device to the receiver's."""
    n = args.mbytes << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=args.device)
    dst = torch.empty(n, dtype=torch.uint8, device=args.decode_device or args.device)
    def sync():
        for t in (src, dst):
            if t.is_cuda:
                torch.cuda.synchronize(t.device)
    for _ in range(3):
        dst.copy_(src)
    sync()
    reps, start = 20, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - start) / reps
    return {"what": "device-to-device copy" if src.is_cuda else "host memcpy", "gb_s": n / seconds / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="serve,bandwidth", help="comma-separated: serve, bandwidth")
    p.add_argument("--backend", nargs="+", default=["zmq", "ipc"], choices=("zmq", "ipc", "mooncake"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--decode-device", default=None,
                   help="the decode side's device (default --device; cuda:1: prefill and decode on two GPUs)")
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=INPUT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--mbytes", type=int, default=256, help="bandwidth: bytes per state (MiB)")
    p.add_argument("--blocks", type=int, default=64, help="bandwidth: cache blocks per state")
    p.add_argument("--count", type=int, default=16, help="bandwidth: states moved per transport")
    p.add_argument("--sender", default=None, help="run as the bandwidth part's sending process, to this address")
    p.add_argument("--out", default=None, help="folder of disagg.json (default bench/results)")
    args = p.parse_args()
    if args.sender:
        args.backend = args.backend[0]
        run_sender(args)
        return
    parts = set(args.parts.split(","))
    result = {**header(), "device_kind": args.device}
    name = f"disagg_{'gpu' if args.device.startswith('cuda') else 'cpu'}"
    if "bandwidth" in parts:
        result["link"] = link_row(args)
        result["bandwidth"] = {b: bandwidth_row(args, b) for b in args.backend}
        for b, row in result["bandwidth"].items():
            row["fraction_of_link"] = row["gb_s"] / result["link"]["gb_s"]
            print(f"bandwidth {b}: {row['gb_s']:.2f} GB/s ({row['fraction_of_link']:.0%} of the "
                  f"{result['link']['what']}, {result['link']['gb_s']:.1f} GB/s)", flush=True)
        write_results(name, result, directory=args.out)  # kept if the serving part fails
    if "serve" in parts:
        with tempfile.TemporaryDirectory() as log_dir:
            result["serve"] = serve_rows(args, Path(log_dir))
        for setup, runs in result["serve"].items():
            if setup.startswith(("colocated", "disaggregated")):
                for c, run in runs.items():
                    s = run["summary"]
                    if not s["completed"]:
                        print(f"{setup:24s} c={c:>3}: every request failed: {s['errors']}")
                        continue
                    print(f"{setup:24s} c={c:>3}: TTFT p50 {s['ttft_p50_ms']:.1f} ms, "
                          f"TPOT p50 {s['tpot_p50_ms']:.2f} ms, p99 {s['tpot_p99_ms']:.2f} ms, "
                          f"{s['output_tok_s']:.0f} tok/s, failed {s['failed']}")
    print(write_results(name, result, directory=args.out))


if __name__ == "__main__":
    main()
