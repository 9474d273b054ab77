"""GIL stall of KV transfers beside a prefill, reproduced then fixed (CPU).

- prefill: a stand-in for an 8k-token prefill, many torch ops on [8192, d] activations (each op releases
  the GIL inside, but dispatching between ops needs it).
- bad transfer: a binding that keeps the GIL during its blocking wait (``ctypes.PyDLL`` usleep, as a
  C extension that forgets Py_BEGIN_ALLOW_THREADS would); the GIL probe finds it with its stack.
- fixed transfer: ``flashinfra.disagg.transport`` (pyzmq multipart, copy=False, from a sender thread).

Prints and writes JSON: prefill time alone, with each kind of concurrent transfer, the ratios, the
probe's stalls. ``python bench/disagg_gil.py --out bench/results/disagg_gil_cpu.json``
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import sys
import threading
import time

import torch

from flashinfra.disagg.layout import CacheLayout, RequestState, TensorDesc
from flashinfra.disagg.transport import StateReceiver, StateSender
from flashinfra.feedback.gil_probe import GilProbe

_libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during calls


def prefill(tokens: int, d: int, layers: int) -> float:
    x = torch.randn(tokens, d)
    w = torch.randn(d, d) / d**0.5
    t0 = time.perf_counter()
    for _ in range(layers):
        for _ in range(8):  # a few ops per layer
            x = torch.nn.functional.silu(x @ w)
            x = x / (x.norm(dim=-1, keepdim=True) + 1)
    return time.perf_counter() - t0


def gil_holding_transfer(stop: threading.Event) -> None:
    while not stop.is_set():
        _libc.usleep(20000)  # "waiting on the transport" while keeping the GIL


def zmq_transfer(stop: threading.Event, mbytes: int) -> int:
    layout = CacheLayout("bench", "fp", 16, (TensorDesc("mla_latent", 0, "uint8", (mbytes << 20,)),))
    rx = StateReceiver(layout)
    sent = [0]

    def serve():
        while not stop.is_set():
            got = rx.recv(timeout_ms=50)
            if got:
                rx.ack(got[0], got[1].request_id)
    srv = threading.Thread(target=serve, daemon=True)
    srv.start()
    tx = StateSender(layout, rx.address, on_ack=lambda rid: sent.__setitem__(0, sent[0] + 1))
    buf = torch.zeros(mbytes << 20, dtype=torch.uint8)
    i = 0
    while not stop.is_set():
        if len(tx.inflight) < 2:
            tx.send(RequestState(str(i), 1, 1, 0), [buf])
            i += 1
        time.sleep(0.005)
    tx.close()
    srv.join(2)
    rx.close()
    return sent[0]


def measure(args, background=None) -> tuple[float, dict]:
    stop = threading.Event()
    th = threading.Thread(target=background, args=(stop,), daemon=True) if background else None
    with GilProbe(threshold_s=0.05) as probe:
        if th:
            th.start()
            time.sleep(0.05)
        times = [prefill(args.tokens, args.d, args.layers) for _ in range(args.reps)]
        stop.set()
        if th:
            th.join(5)
    return min(times), probe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mbytes", type=int, default=16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prefill(args.tokens, args.d, 1)  # warm up
    alone, _ = measure(args)
    bad, bad_probe = measure(args, gil_holding_transfer)
    moved = {}
    good, good_probe = measure(args, lambda stop: moved.__setitem__("n", zmq_transfer(stop, args.mbytes)))
    culprit = bad_probe.stalls[0].culprit_lines() if bad_probe.stalls else []
    result = {
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads 1)",
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tokens": args.tokens, "prefill_alone_s": alone,
        "gil_holding_transfer": {"prefill_s": bad, "ratio": bad / alone, "stalls": bad_probe.count,
                                 "max_stall_s": bad_probe.max_s, "culprit": culprit[:6]},
        "zmq_transfer": {"prefill_s": good, "ratio": good / alone, "stalls": good_probe.count,
                         "max_stall_s": good_probe.max_s, "transfers_acked": moved.get("n", 0),
                         "mbytes_each": args.mbytes},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
