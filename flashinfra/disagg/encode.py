"""The encode role: a vision-tower-only engine, and the prefill side's client that fetches embeddings from it.

``EncodeServer`` (``flashinfra serve --role encode``) holds only the vision tower (``load_tower``: the
``model.visual.*`` tensors, no language-model weights) behind a ZeroMQ ROUTER socket. ``EncodeClient``
(``disagg.remote_encode``, in a prefill or both engine) connects one DEALER per encode engine and asks for the
images/videos a request needs that its encoder cache lacks: one multipart message ``[header, *canvases]``; the
answer is ``[header, *embeddings]``, the rows of each item keyed by its content hash (the encoder cache's key),
sent and read in place (``copy=False``). Through ``disagg.channel``'s handshake, the first message on a connection
carries the client's layout (``embedding_layout``: the tower's fingerprint, its output width and dtype) and a
mismatch is refused with both names; every socket belongs to one background thread, woken through an inproc socket,
so the engine loop never waits on the network; an encode engine that dies fails its outstanding requests at once
(socket monitor, heartbeats), one that does not answer fails them after ``timeout_s``. Results are taken with
``EncodeClient.poll``.

The encode engine runs the tower on its socket thread, one message (one request's missing items) at a
time, in runs of at most ``ENCODER_BATCH_PATCHES`` patches (``multimodal.encoder.encode_items``).
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from pathlib import Path
from typing import Callable

import msgspec
import numpy as np
import torch
import zmq

from flashinfra.disagg.layout import CacheLayout, TensorDesc, fingerprint
from flashinfra.disagg.channel import (HandshakeServer, Hello, Reply, Waker, close_peer, connect_peer,
                                       disconnected)
from flashinfra.engine.sched.messages import MultiModalItem


class _Encode(msgspec.Struct, tag="encode"):
    """Items to encode; their canvases follow as frames, in order (``MultiModalItem.pixels`` left empty)."""

    job_id: int
    items: list[MultiModalItem]


class _Embedded(msgspec.Struct, tag="embedded"):
    """Embeddings of a job's items: one frame of rows ``[num_embeds, width]`` per content hash, in order."""

    job_id: int
    content_hashes: list[str] = []
    error: str = ""


_enc = msgspec.msgpack.Encoder()
_to_server = msgspec.msgpack.Decoder(Hello | _Encode)
_to_client = msgspec.msgpack.Decoder(Reply | _Embedded)


def embedding_layout(vision_config, width: int, dtype: torch.dtype, name: str) -> CacheLayout:
    """What an encode engine hands out: rows of ``width`` in ``dtype`` from the tower described by ``vision_config``."""
    return CacheLayout(name=name, model_fingerprint=fingerprint(vision_config), block_size=0,
                       tensors=(TensorDesc("embeddings", 0, str(dtype).removeprefix("torch."), (width,)),))


def load_tower(path: str | Path, dtype: str, device: str):
    """The checkpoint's vision tower alone (``model.visual.*``) and the model config it belongs to."""
    from flashinfra.model.api import _load_vision
    from flashinfra.config import load_config
    from flashinfra.model.loader import CheckpointReader
    from flashinfra.model.api import resolve_dtype

    config = load_config(Path(path))
    return _load_vision(config, CheckpointReader(Path(path)), resolve_dtype(dtype), torch.device(device)), config


class EncodeServer(HandshakeServer):
    """Answers ``EncodeClient`` requests with the tower's embeddings, from its own thread."""

    def __init__(self, tower, layout: CacheLayout, address: str = "tcp://127.0.0.1:*",
                 device: torch.device | str = "cpu") -> None:
        self.tower, self.device = tower, torch.device(device)
        self.num_encoded = 0
        self.num_failures = 0
        super().__init__(layout, address, _to_server.decode, "disagg-encoder")

    def _refuse(self, msg: _Encode) -> list:
        err = "no layout handshake on this connection (the encode engine restarted?)"
        return [_enc.encode(_Embedded(msg.job_id, error=err))]

    def _handle(self, peer: bytes, msg: _Encode, frames: list) -> None:
        self._sock.send_multipart([peer, *self._encode(msg, frames)], copy=False)

    def _encode(self, msg: _Encode, frames: list) -> list:
        from flashinfra.multimodal.encoder import encode_items

        try:
            if len(frames) != len(msg.items):
                raise ValueError(f"{len(frames)} canvases for {len(msg.items)} items")
            items = [msgspec.structs.replace(it, pixels=f.buffer) for it, f in zip(msg.items, frames)]
            with torch.inference_mode():
                rows = encode_items(self.tower, items, self.device)
        except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
            self.num_failures += 1
            return [_enc.encode(_Embedded(msg.job_id, error=f"the encode engine failed: {type(e).__name__}: {e}"))]
        self.num_encoded += len(items)
        bufs = [memoryview(r.contiguous().cpu().view(-1).view(torch.uint8).numpy()) for r in rows]
        return [_enc.encode(_Embedded(msg.job_id, [it.content_hash for it in items]))] + bufs


class EncodeClient:
    """Asks encode engines for embeddings from its own thread; ``poll`` gives (content hash, rows or None,
    error or None) per item."""

    def __init__(self, layout: CacheLayout, timeout_s: float = 30.0, wake: Callable[[], None] | None = None):
        self.layout, self.timeout_s = layout, timeout_s
        (desc,) = layout.tensors
        self._dtype, self._width = getattr(torch, desc.dtype), desc.shape[0]
        self._ctx = zmq.Context.instance()
        self._wake_owner = wake
        self._waker = Waker(self._ctx)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done: collections.deque = collections.deque()
        self._jobs = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="disagg-encode-client", daemon=True)
        self._thread.start()

    def request(self, peer: str, items: list[MultiModalItem]) -> None:
        """Queue the encoding of ``items`` at the encode engine ``peer``; returns at once."""
        self._queue.put((peer, items))
        self._waker.wake()

    def poll(self) -> list[tuple[str, torch.Tensor | None, str | None]]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _finish(self, results: list) -> None:
        self._done.extend(results)
        if self._wake_owner is not None:
            self._wake_owner()

    def _connect(self, peer: str, poller: zmq.Poller) -> tuple[zmq.Socket, zmq.Socket]:
        return connect_peer(self._ctx, peer, _enc.encode(Hello(self.layout)), _to_client.decode, Reply,
                            "the encode engine", poller, RuntimeError)

    def _rows(self, frame) -> torch.Tensor:
        raw = torch.from_numpy(np.frombuffer(frame.buffer, dtype=np.uint8).copy())
        return raw.view(self._dtype).view(-1, self._width)

    def _loop(self) -> None:
        peers: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}
        jobs: dict[int, tuple[float, str, list[MultiModalItem]]] = {}  # job id -> (deadline, peer, items)
        poller = zmq.Poller()
        poller.register(self._waker.pull, zmq.POLLIN)

        def fail(job_id: int, error: str) -> None:
            _, _, items = jobs.pop(job_id)
            self._finish([(it.content_hash, None, error) for it in items])

        while not self._stop:
            wait = min((d for d, _, _ in jobs.values()), default=None)
            events = dict(poller.poll(None if wait is None else max(0, int((wait - time.monotonic()) * 1000) + 1)))
            if self._waker.pull in events:
                self._waker.drain()
            while True:
                try:
                    peer, items = self._queue.get_nowait()
                except queue.Empty:
                    break
                job_id = next(self._jobs)
                jobs[job_id] = (time.monotonic() + self.timeout_s, peer, items)
                try:
                    if peer not in peers:
                        peers[peer] = self._connect(peer, poller)
                    head = _enc.encode(_Encode(job_id, [msgspec.structs.replace(it, pixels=b"") for it in items]))
                    peers[peer][0].send_multipart([head, *(it.pixels for it in items)], flags=zmq.NOBLOCK, copy=False)
                except Exception as e:  # noqa: BLE001 - these items fail, the engine goes on
                    fail(job_id, f"encode request to {peer} failed: {type(e).__name__}: {e}")
            for peer, (sock, monitor) in list(peers.items()):
                lost = monitor in events and disconnected(monitor)
                while sock in events or lost:
                    try:
                        head, *frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    msg = _to_client.decode(head.buffer)
                    if not isinstance(msg, _Embedded) or msg.job_id not in jobs:
                        continue
                    if msg.error:
                        lost = lost or msg.error.startswith("no layout handshake")
                        fail(msg.job_id, msg.error)
                        continue
                    del jobs[msg.job_id]
                    self._finish([(h, self._rows(f), None) for h, f in zip(msg.content_hashes, frames)])
                if lost:
                    for s in (sock, monitor):
                        poller.unregister(s)
                    close_peer(sock, monitor)
                    del peers[peer]
                    for job_id in [j for j, (_, to, _) in jobs.items() if to == peer]:
                        fail(job_id, f"the encode engine at {peer} went away (connection lost)")
            now = time.monotonic()
            for job_id in [j for j, (d, _, _) in jobs.items() if d <= now]:
                fail(job_id, f"the encode engine at {jobs[job_id][1]} did not answer within {self.timeout_s:g} s")
        for sock, monitor in peers.values():
            close_peer(sock, monitor)

    def close(self) -> None:
        self._stop = True
        self._waker.wake()
        self._thread.join(timeout=5)
        self._waker.close()
