"""GIL stall of KV transfers beside a prefill, reproduced then fixed (CPU).

- prefill: by default a stand-in for an 8k-token prefill, many torch ops on [8192, d] activations (each op
  releases the GIL inside, but dispatching between ops needs it); with ``--engine``, one step of a real
  ``EngineCore`` (the built-in model, or ``--model``) computing a ``--tokens``-token prompt.
- bad transfer: a binding that keeps the GIL during its blocking wait (``ctypes.PyDLL`` usleep, as a
  C extension that forgets Py_BEGIN_ALLOW_THREADS would); the GIL probe finds it with its stack.
- fixed transfer: the engines' own paths, moving ``--mbytes`` per transfer, two at a time, to a receiver in
  another process (the decode engine's side): ``flashinfra.disagg.transport`` (a request's pages packed as it is
  sent, pyzmq multipart with copy=False, a receiver thread, acks) and ``flashinfra.disagg.ipc`` (the receiver's
  reader thread copying the pages from the sender's cache in shared memory, or through CUDA IPC when the caches
  are on the GPU: ``--engine --device cuda``). The sender has no thread: the prefill's own thread plays the
  engine loop's part, polling and sending between repetitions, so the states move while the next prefill runs
  (a zmq state packed from a GPU cache by a side-stream copy is sent by the first poll after the copy, as in
  the engine: it moves during the prefill after the one that its copy overlapped).
- on a GPU, the control of the ``ipc`` row (``gpu_neighbour``): another process copying as many bytes within its own
  GPU memory at the same times, with no transfer: with both engines on one GPU, the decode side's copies share the
  GPU with the prefill (time-sliced between the two processes), which no transfer path can avoid. With
  ``--decode-device cuda:1`` the receiver's cache is on a second GPU (CUDA IPC reads across the two), and there is
  no control row.

The ratio is the prefill's best time with the transfers running beside it, divided by its best time alone, in one
process: what the transfers cost the engine loop (GIL hand-offs and CPU), not the transfer's own speed. The
transports are timed in paired rounds (``--rounds``; each round times alone and every transport in a random order,
``paired_rounds``), so each also has the median over rounds of its time / that round's alone time, the figure
that a drifting machine does not bias (a GPU's clocks, other processes). The GIL-holding binding is timed over
``--reps`` on its own. Prints and writes JSON: the times, the ratios, the probe's stalls.
``python bench/disagg_gil.py --reps 5 --rounds 7 --out bench/results/disagg_gil_cpu.json``
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import os
import platform
import random
import statistics
import sys
import threading
import time

import torch

from flashinfra.disagg.layout import RequestPages, RequestState, describe
from flashinfra.disagg.transport import StateReceiver, StateSender
from flashinfra.feedback.gil_probe import GilProbe
from flashinfra.model.cache import ModelCache

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


def gil_holding_transfer(stop: threading.Event, ready: threading.Event) -> None:
    ready.set()
    while not stop.is_set():
        _libc.usleep(20000)  # "waiting on the transport" while keeping the GIL


def _cache(mbytes: int, device: str) -> ModelCache:
    """A cache of two blocks of one paged tensor, ``mbytes`` each."""
    return ModelCache(block_size=1, num_blocks=2, num_slots=1, indexer_keys={}, conv_state={}, recurrent_state={},
                      mla_latent={0: torch.zeros(2, 1, mbytes << 20, dtype=torch.uint8, device=device)})


def receiver_process(conn, stop, mbytes: int, backend: str, device: str) -> None:
    """The decode side, in its own process as in serving: a receiver that takes each state (the ``ipc`` reader
    copying it from the sender's cache) and acknowledges it, until ``stop``."""
    from flashinfra.disagg.ipc import IpcReceiver

    dst = _cache(mbytes, device)
    layout = describe(dst, "bench", "bench")
    rx = IpcReceiver(layout, dst) if backend == "ipc" else StateReceiver(layout)
    conn.send(rx.address)
    arrived = {}
    while not stop.is_set():
        for arrival in rx.poll():
            if backend == "ipc":
                arrived[arrival.state.request_id] = arrival
                rx.read(arrival, dst, [int(arrival.state.request_id) % 2], None)
            else:
                rx.ack(arrival.peer, arrival.state.request_id)
        for tid, _ in rx.poll_reads() if backend == "ipc" else []:
            rx.ack(arrived.pop(tid).peer, tid)
        time.sleep(0.002)
    rx.close()


class StateTransfers:
    """The prefill side's sender, moving request states of ``mbytes`` (one block of one paged tensor) from its
    cache to a receiver in another process, two in flight: as frames (``zmq``), or copied from the sender's cache
    by the receiver's reader (``ipc``: shared memory on a CPU, CUDA IPC on a GPU). The sender has no thread: the
    prefill's own thread drives it as the engine loop does, ``between`` prefills (poll the acknowledgements, then
    send states up to two in flight, which move while the next prefill runs). Start-up work (the connection, the
    handshake, the ``ipc`` receiver's mapping) is over, two states acknowledged, before it returns."""

    def __init__(self, mbytes: int, backend: str, device: str, receiver_device: str) -> None:
        import multiprocessing as mp

        from flashinfra.disagg.ipc import IpcSender

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._halt = ctx.Event()
        self._proc = ctx.Process(target=receiver_process,
                                 args=(child, self._halt, mbytes, backend, receiver_device), daemon=True)
        self._proc.start()
        self._src = _cache(mbytes, device)
        layout = describe(self._src, "bench", "bench")
        self.tx = IpcSender(layout, self._src) if backend == "ipc" else StateSender(layout)
        self._address = parent.recv()
        self.acked, self._sent = 0, 0
        deadline = time.monotonic() + 60
        while self.acked < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{backend}: no state acknowledged within 60 s of the start")
            self.between()
            time.sleep(0.002)
        self.acked = 0  # the transfers acknowledged while prefills ran

    def between(self) -> None:
        for rid, error in self.tx.poll():
            if error is not None:
                raise RuntimeError(f"transfer {rid} failed: {error}")
            self.acked += 1
        while self.tx.num_outstanding < 2:
            i = self._sent
            self.tx.send(self._address, RequestState(str(i), 1, 1, 0), RequestPages(self._src, [i % 2], None))
            self._sent += 1

    def close(self) -> None:
        self.tx.close()
        self._halt.set()
        self._proc.join(10)


def neighbour_process(conn, stop, mbytes: int, device: str) -> None:
    """The control of the ``ipc`` row on one GPU: a process that copies as many bytes within its own memory as the
    ``ipc`` reader copies out of the sender's cache, two ``mbytes`` copies whenever the prefill's thread asks,
    with no transfer at all: what sharing the GPU with another process's copies costs the prefill by itself."""
    src, dst = (torch.zeros(mbytes << 20, dtype=torch.uint8, device=device) for _ in range(2))
    conn.send("ready")
    while not stop.is_set():
        if conn.poll(0.002):
            for _ in range(conn.recv()):
                dst.copy_(src)
            torch.cuda.synchronize() if dst.is_cuda else None


class GpuNeighbour:
    """Drives ``neighbour_process`` as ``StateTransfers`` drives a receiver: two copies asked ``between`` prefills."""

    def __init__(self, mbytes: int, device: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._halt = ctx.Event()
        self._proc = ctx.Process(target=neighbour_process, args=(child, self._halt, mbytes, device), daemon=True)
        self._proc.start()
        self._conn.recv()
        self.acked = 0

    def between(self) -> None:
        self._conn.send(2)
        self.acked += 2

    def close(self) -> None:
        self._halt.set()
        self._proc.join(10)


def long_enough(model: str | None, length: int) -> str:
    """``model`` (default: the built-in one), or a copy of it whose ``max_position_embeddings`` admits ``length``
    tokens (the built-in model's 4,096 is below an 8k prompt; the step's cost is what is timed, not its text)."""
    import shutil
    import tempfile
    from pathlib import Path

    from flashinfra.model.factory import default_model_dir

    src = Path(model) if model else default_model_dir()
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    if text["max_position_embeddings"] >= length:
        return str(src)
    dst = Path(tempfile.mkdtemp(prefix="disagg-gil-model-"))
    shutil.copytree(src, dst, dirs_exist_ok=True)
    text["max_position_embeddings"] = length
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


def engine_prefill(args):
    """A function that times one prefill step of a real engine on a fresh ``args.tokens``-token prompt."""
    from flashinfra.engine.config import EngineConfig
    from flashinfra.engine.core import EngineCore
    from flashinfra.engine.sched.messages import EngineRequest, SamplingParams
    from flashinfra.feedback.timing import checked_step

    core = EngineCore(EngineConfig(model=long_enough(args.model, args.tokens + 8), device=args.device, max_num_seqs=1,
                                   prefix_cache_slots=0,
                                   max_num_batched_tokens=args.tokens, max_model_len=args.tokens + 8,
                                   num_blocks=args.tokens // 16 + 2))
    count = [0]

    def run(*_):
        count[0] += 1
        prompt = [(count[0] * 7919 + 31 * i) % 500 + 3 for i in range(args.tokens)]
        core.add_request(EngineRequest(f"p{count[0]}", prompt, SamplingParams(max_tokens=1, temperature=0.0),
                                       time.time()))
        t0 = time.perf_counter()
        while core.has_unfinished():
            checked_step(core)
        return time.perf_counter() - t0
    return run


def measure(args, run_prefill, background=None, between=None) -> tuple[float, dict]:
    """The prefill's best time over ``args.reps`` (and the GIL probe's record) while ``background(stop, ready)``
    runs on a thread, timed from when it is ready; ``between()`` runs on this thread before each repetition and
    after the last."""
    stop, ready = threading.Event(), threading.Event()
    th = threading.Thread(target=background, args=(stop, ready), daemon=True) if background else None
    if th:
        th.start()
        ready.wait(60)
    times = []
    with GilProbe(threshold_s=0.01) as probe:  # the bad binding holds the GIL 20 ms at a time
        for _ in range(args.reps):
            if between:
                between()
            times.append(run_prefill())
        if between:
            between()
        stop.set()
    if th:
        th.join(5)
    return min(times), probe


def paired_rounds(args, run_prefill, drivers: dict) -> list[dict]:
    """``args.rounds`` rounds; in each, every driver in a fresh random order gets a block of two prefills with its
    transfers driven ``between`` them (None: alone): the first lets the previous block's transfers drain and its own
    start, the second is timed, under a GIL probe of its own. Slow drifts of the machine (clocks, neighbours) hit
    a round's blocks alike, so a round's ratio to its own ``alone`` is the figure to trust on a noisy host."""
    rng = random.Random(0)
    rounds = []
    for _ in range(args.rounds):
        order = list(drivers)
        rng.shuffle(order)
        row = {}
        for name in order:
            between = drivers[name].between if drivers[name] is not None else None
            for timed in (False, True):
                if between:
                    between()
                if not timed:
                    run_prefill()
                    continue
                with GilProbe(threshold_s=0.01) as probe:
                    t = run_prefill()
                row[name] = {"prefill_s": t, "stalls": probe.count, "max_stall_s": probe.max_s}
        rounds.append(row)
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds of the transports against alone")
    ap.add_argument("--mbytes", type=int, default=16)
    ap.add_argument("--engine", action="store_true", help="time a real engine's prefill step")
    ap.add_argument("--model", default=None, help="with --engine: checkpoint (default: the built-in model)")
    ap.add_argument("--device", default="cpu", help="with --engine: the engine's device (cpu, cuda)")
    ap.add_argument("--decode-device", default=None,
                    help="with --engine: the receiving side's device (default --device; cuda:1: across two GPUs)")
    ap.add_argument("--skip-gil-holding", action="store_true", help="leave out the GIL-holding binding's row")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine:
        run_prefill = engine_prefill(args)
    else:
        run_prefill = functools.partial(prefill, args.tokens, args.d, args.layers)
    run_prefill()  # warm up
    alone, _ = measure(args, run_prefill)
    print(f"prefill alone {alone * 1e3:.2f} ms", flush=True)  # each phase as it ends: a crash shows where it was
    bad, bad_probe = (None, None) if args.skip_gil_holding else measure(args, run_prefill, gil_holding_transfer)
    if bad is not None:
        print(f"beside a GIL-holding transfer {bad * 1e3:.2f} ms", flush=True)
    device = args.device if args.engine else "cpu"
    decode_device = (args.decode_device or device) if args.engine else "cpu"
    # the control shares the prefill's GPU; across two GPUs nothing does
    names = ("zmq", "ipc") + (("gpu_neighbour",) if device.startswith("cuda") and decode_device == device else ())
    drivers = {}
    try:
        for backend in names:
            drivers[backend] = (GpuNeighbour(args.mbytes, device) if backend == "gpu_neighbour"
                                else StateTransfers(args.mbytes, backend, device, decode_device))
        rounds = paired_rounds(args, run_prefill, {"alone": None, **drivers})
    finally:
        for d in drivers.values():
            d.close()
    alone = min(alone, min(r["alone"]["prefill_s"] for r in rounds))
    transfers = {}
    for b in names:
        mine = [r[b] for r in rounds]
        best = min(m["prefill_s"] for m in mine)
        transfers[b if b == "gpu_neighbour" else f"{b}_transfer"] = {
            "prefill_s": best, "ratio": best / alone,
            "paired_ratio_median": statistics.median(r[b]["prefill_s"] / r["alone"]["prefill_s"] for r in rounds),
            "stalls": sum(m["stalls"] for m in mine), "max_stall_s": max(m["max_stall_s"] for m in mine),
            "transfers_acked": drivers[b].acked, "mbytes_each": args.mbytes}
        print(f"beside {b}: best {best * 1e3:.2f} ms, paired ratio (median of {len(rounds)}) "
              f"{transfers[b if b == 'gpu_neighbour' else f'{b}_transfer']['paired_ratio_median']:.3f}", flush=True)
    culprit = bad_probe.stalls[0].culprit_lines() if bad_probe is not None and bad_probe.stalls else []
    result = {
        "device": (f"{device}{'' if decode_device == device else f', receiver on {decode_device}'} "
                   f"({platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads 1)"),
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "prefill": "engine step" if args.engine else "torch stand-in", "tokens": args.tokens,
        "prefill_alone_s": alone,
        "transfers_driven_by": "the prefill's thread between repetitions, as the engine loop (no sender thread)",
        "gil_holding_transfer": None if bad is None else {
            "prefill_s": bad, "ratio": bad / alone, "stalls": bad_probe.count, "max_stall_s": bad_probe.max_s,
            "culprit": culprit[:6]},
        **transfers,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
