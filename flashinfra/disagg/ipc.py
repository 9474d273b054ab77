"""Mapped memory as the data plane of ``disagg.in_place`` (``--transfer-backend ipc``), for a prefill and a
decode engine on one host: the decode engine maps the prefill engine's cache tensors into its own address
space once, at the handshake, and copies each request's pages from there with ordinary tensor copies.

GPU caches are shared by CUDA IPC (the memory handle of each tensor's allocation, ``cudaIpcOpenMemHandle``
on the other side, also between two processes on one GPU); the copies run device to device on the reader
thread's own stream, ordered after the engine's, and the thread waits for them with the GIL released. CPU
caches move into POSIX shared memory when the sender starts (``/dev/shm``, named files kept by torch's
shared-memory manager, so that an unrelated process can map them); the copies are ``memcpy`` with the GIL
released. The handles travel in the handshake as plain data (never pickled), with each tensor's dtype, shape,
strides and offset; the receiver checks them against its own layout.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Callable

import msgspec
import torch

from flashinfra.disagg.in_place import InPlaceReceiver, InPlaceSender
from flashinfra.disagg.layout import CacheLayout, Caches, LayoutMismatch, cache_tensors
from flashinfra.disagg.transport import Arrival, TransferError

SHM = "/dev/shm"
IDLE_UNMAP_S = 60.0  # a sender's cache mapped here but unused this long is unmapped (mapped again on use)


class SharedTensor(msgspec.Struct, array_like=True):
    """One cache tensor as another process maps it: ``handle`` is the storage's sharing handle (CUDA:
    ``UntypedStorage._share_cuda_()``'s fields; CPU: the shared-memory manager and file, and the size)."""

    device: str
    handle: list[int | bytes | bool | None]
    dtype: str
    shape: list[int]
    stride: list[int]
    offset: int


class SharedCache(msgspec.Struct):
    session: str  # one per sender: a receiver maps each sender's cache once
    tensors: list[SharedTensor]


def share(t: torch.Tensor) -> SharedTensor:
    """The handle of ``t``'s storage for another process (a CPU storage moves into shared memory first: its
    tensors keep working, at the new address)."""
    storage = t.untyped_storage()
    if not storage.nbytes():
        handle = []  # nothing to map
    elif t.is_cuda:
        handle = list(storage._share_cuda_())
    else:
        handle = list(storage._share_filename_cpu_())
    return SharedTensor(str(t.device), handle, str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()),
                        t.storage_offset())


def open_shared(s: SharedTensor) -> torch.Tensor:
    """The tensor ``s`` describes, mapped from its owner's memory."""
    dtype = getattr(torch, s.dtype)
    if not s.handle:
        return torch.empty(s.shape, dtype=dtype, device=s.device)
    if s.device.startswith("cuda"):
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(*s.handle)
    else:
        storage = torch.UntypedStorage._new_shared_filename_cpu(*s.handle)
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, s.offset, s.shape, s.stride)


class IpcSender(InPlaceSender):
    """Shares its cache tensors at start and sends their handles in every handshake."""

    backend = "ipc"

    def __init__(self, layout: CacheLayout, caches: Caches, **kw):
        tensors = [t for _, _, t in cache_tensors(caches)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_cuda}
        host_bytes = sum(storages.values())
        if host_bytes and os.path.isdir(SHM):
            st = os.statvfs(SHM)
            if st.f_bavail * st.f_frsize < host_bytes:
                raise TransferError(f"--transfer-backend ipc puts the {host_bytes / 2**20:.0f} MiB CPU cache in "
                                    f"{SHM}, which has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free (a smaller "
                                    f"--num-blocks, a larger {SHM}, or another backend)")
        self.session = f"ipc-{uuid.uuid4().hex}"
        shared = SharedCache(self.session, [share(t) for t in tensors])
        self._shared = msgspec.msgpack.encode(shared)
        super().__init__(layout, caches, **kw)

    def _hello_extra(self) -> bytes:
        return self._shared

    def _address(self, t) -> int:
        return 0  # the receiver names the sender's tensors by their order in the handshake


class IpcReceiver(InPlaceReceiver):
    """Maps each sender's cache at its handshake; copies a request's runs from there into ``caches``.

    A mapping keeps the sender's memory alive, also after the sender is gone (a prefill engine that restarted
    shares a new cache under a new session): a sender's cache unused for ``IDLE_UNMAP_S`` is unmapped, and
    mapped again from its handshake's handles when a transfer names it (which fails, naming the session, once
    its owner has exited)."""

    backend = "ipc"

    def __init__(self, layout: CacheLayout, caches: Caches, address: str = "tcp://127.0.0.1:*",
                 wake: Callable[[], None] | None = None):
        self._local = [t for _, _, t in cache_tensors(caches)]
        self._shared: dict[str, SharedCache] = {}  # sender session -> its handshake's handles
        self._mapped: dict[str, tuple[list[torch.Tensor], float]] = {}  # session -> (tensors mapped here, last use)
        self._lock = threading.Lock()  # the handshake thread maps, the engine's thread maps and unmaps
        device = next((t.device for t in self._local if t.is_cuda), None)
        self._stream = torch.cuda.Stream(device) if device is not None else None
        super().__init__(layout, address, wake)

    def _accept(self, peer: bytes, hello) -> None:
        """Check the sender's shared cache against this engine's and map it (once per sender)."""
        try:
            shared = msgspec.msgpack.decode(hello.extra, type=SharedCache)
        except msgspec.DecodeError as e:
            raise LayoutMismatch(f"the handshake of {hello.layout.name} carries no shared cache ({e})") from e
        if len(shared.tensors) != len(self._local):
            raise LayoutMismatch(f"{hello.layout.name} shares {len(shared.tensors)} cache tensors, "
                                 f"{self.layout.name} has {len(self._local)}")
        for s, t in zip(shared.tensors, self._local):
            if ((s.dtype, s.shape) != (str(t.dtype).removeprefix("torch."), list(t.shape))
                    or s.device.split(":")[0] != t.device.type):
                raise LayoutMismatch(f"shared cache tensor {s.dtype}{s.shape} on {s.device} vs {t.dtype}"
                                     f"{list(t.shape)} on {t.device} here (one host, the same device kind)")
        self._shared[shared.session] = shared
        try:
            self._map(shared.session)
        except RuntimeError as e:
            raise LayoutMismatch(f"could not map the cache of {hello.layout.name} (same host? {e})") from e

    def _map(self, session: str) -> list[torch.Tensor]:
        """The session's tensors, mapped now if they are not; every other mapping idle too long is dropped (a
        copy in flight holds its own views, so its memory stays until it is over)."""
        now = time.monotonic()
        with self._lock:
            tensors = self._mapped[session][0] if session in self._mapped else None
            if tensors is None:
                tensors = [open_shared(s) for s in self._shared[session].tensors]
            self._mapped[session] = (tensors, now)
            for other, (_, used) in list(self._mapped.items()):
                if other != session and now - used > IDLE_UNMAP_S:
                    del self._mapped[other]
        return tensors

    def _plan(self, arrival: Arrival, runs: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) views, one per run."""
        session = arrival.source.session
        if session not in self._shared:
            raise LayoutMismatch(f"no handshake shared a cache as session {session}")
        try:
            mapped = self._map(session)
        except RuntimeError as e:
            raise LayoutMismatch(f"the cache of sender session {session} cannot be mapped any more (its engine "
                                 f"exited?): {e}") from e
        return [(t[dst:dst + n], mapped[i][src:src + n]) for i, t, _, tensor_runs in runs
                for src, dst, n in tensor_runs]

    def _copy(self, job: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
        if self._stream is None:
            for dst, src in job:
                dst.copy_(src)
            return None
        self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            for dst, src in job:
                dst.copy_(src, non_blocking=True)
        self._stream.synchronize()
        return None
