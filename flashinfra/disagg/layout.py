"""The described layout of an engine's cache, and one request's state packed against it.

Nothing moves without being described: a ``CacheLayout`` names every cache tensor (kind, layer, dtype,
per-block or per-slot shape) plus the block size and a model fingerprint. Two engines compare layouts in
their handshake; ``check_compatible`` refuses any mismatch with a message naming both sides.

An engine's caches are its model cache plus, with speculative decoding, the MTP layer's paged cache (same
block tables; its layer index follows the trunk's, so every (kind, layer) names one tensor).
``pack_request_state`` gathers one request's pages (by block id) and its KDA slot (conv window + recurrent
state, the committed checkpoint when speculation is on) into contiguous per-tensor buffers (on a GPU, on a side
stream when the caller must not wait for the device);
``unpack_request_state`` scatters them into the receiver's own block ids and slot. Buffers are raw bytes, so a
transport can send them without Python touching them.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from flashinfra.engine.sched.messages import TokenLogprob
from flashinfra.model.cache import ModelCache


class TensorDesc(msgspec.Struct, frozen=True):
    kind: str  # one of PAGED (per block) or SLOTTED (per slot)
    layer: int
    dtype: str
    shape: tuple[int, ...]  # per block ([block_size, width]) or per slot


class CacheLayout(msgspec.Struct, frozen=True):
    name: str  # which engine, for error messages
    model_fingerprint: str
    block_size: int
    tensors: tuple[TensorDesc, ...]


class RequestState(msgspec.Struct):
    """One request's moved state besides its buffers (which follow ``layout.tensors``' order): the
    transfer it belongs to, what was computed, the first sampled token (with its logprobs when the request
    asked for them) and the sampling generator."""

    request_id: str  # the transfer id both engines were given
    prompt_len: int
    num_blocks: int
    first_token: int
    prompt_hash: str = ""  # the receiver refuses a state computed for other prompt tokens
    generator_state: bytes = b""  # torch.Generator state after the first token (empty: greedy)
    first_logprob: TokenLogprob | None = None  # None: the request did not ask for logprobs
    # speculative decoding: the target's hidden state at the last prompt position (raw bytes, model dtype)
    # and the MTP drafts made after the first token
    hidden: bytes = b""
    drafts: list[int] = []


# scales: 8-bit caches only. The indexer's pool keys move with their pages rather than being rebuilt on import: they
# are 1 / (2 kpool) of the bf16 entries' bytes (an eighth at kpool 4), and a rebuild would need the indexer's
# weights (the pool position bias) and a kernel launch in the transfer path, which knows neither.
PAGED = ("mla_latent", "indexer_keys", "mla_latent_scale", "indexer_scale", "indexer_pool_keys")
SLOTTED = ("conv_state", "recurrent_state")


class LayoutMismatch(ValueError):
    pass


Caches = ModelCache | tuple[ModelCache, ...]


def cache_tensors(caches: Caches):
    """(kind, layer, tensor) of every described cache tensor, in the layout's order."""
    for cache in caches if isinstance(caches, tuple) else (caches,):
        for kind in PAGED + SLOTTED:
            for layer, t in sorted(getattr(cache, kind).items()):
                yield kind, layer, t


def describe(cache: Caches, model_fingerprint: str, name: str = "engine") -> CacheLayout:
    return CacheLayout(
        name=name,
        model_fingerprint=model_fingerprint,
        block_size=(cache[0] if isinstance(cache, tuple) else cache).block_size,
        tensors=tuple(
            TensorDesc(kind, layer, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
            for kind, layer, t in cache_tensors(cache)
        ),
    )


def fingerprint(obj: object) -> str:
    """A short stable hash of a model config (anything with a deterministic repr / msgspec encoding)."""
    try:
        data = msgspec.json.encode(obj)
    except TypeError:
        data = repr(obj).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def token_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(token_ids)).hexdigest()[:16]


def check_compatible(local: CacheLayout, remote: CacheLayout) -> None:
    """Raise ``LayoutMismatch`` naming both sides and the first differences; return if they agree."""
    problems = []
    if local.model_fingerprint != remote.model_fingerprint:
        problems.append(f"model fingerprint {local.model_fingerprint} vs {remote.model_fingerprint}")
    if local.block_size != remote.block_size:
        problems.append(f"block size {local.block_size} vs {remote.block_size}")
    mine = {(t.kind, t.layer): t for t in local.tensors}
    theirs = {(t.kind, t.layer): t for t in remote.tensors}
    for key in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            problems.append(f"{key[0]}[{key[1]}] only on {local.name if b is None else remote.name}")
        elif a != b:
            problems.append(f"{key[0]}[{key[1]}] {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    if problems:
        raise LayoutMismatch(
            f"cache layout mismatch between {local.name} and {remote.name}: " + "; ".join(problems[:8])
            + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else "")
        )


@dataclass(frozen=True)
class RequestPages:
    """Where one request's state lies in an engine's caches: its blocks and KDA slot. Calling it packs them
    (``pack_request_state``); a transport that reads the cache in place (``disagg.mooncake``) takes the ids."""

    caches: Caches
    block_ids: list[int]
    slot: int | None

    @property
    def device(self) -> torch.device | None:
        """The GPU the caches lie on (None: the CPU)."""
        return next((t.device for _, _, t in cache_tensors(self.caches) if t.is_cuda), None)

    def __call__(self, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        return pack_request_state(self.caches, self.block_ids, self.slot, stream)


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, count)``: the pairing of ``src[i]`` with ``dst[i]`` cut into runs of ids
    consecutive on both sides (one copy each)."""
    runs: list[list[int]] = []
    for a, b in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [tuple(r) for r in runs]


ALIGN = 64  # bytes: where each tensor's part of a packed buffer starts (any dtype views it in place)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one block (paged tensors) or one slot (slotted tensors) of a cache tensor."""
    return t[0].numel() * t.element_size() if t.shape[0] else 0


def _rows(kind: str, block_ids: list[int], slot: int | None) -> list[int]:
    return list(block_ids) if kind in PAGED else [] if slot is None else [slot]


def pack_request_state(cache: Caches, block_ids: list[int], slot: int | None,
                       stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
    """One CPU byte buffer per layout tensor, all views of a single allocation (pinned when the cache is on a
    GPU): the pages of ``block_ids``, then the slot. Each run of consecutive blocks is one copy straight from
    the cache (device to host on a GPU), so every byte is copied once, and no gathered copy is made first.

    On a GPU the copies run on the current stream, which is waited for before this returns; or, given
    ``stream`` (a side stream of the cache's device), on that stream after the work queued so far on the
    current one, not waited for: the buffers hold the state once an event recorded on ``stream`` after this
    call is done."""
    items = [(t, _rows(kind, block_ids, slot)) for kind, _, t in cache_tensors(cache)]
    sizes = [len(rows) * row_bytes(t) for t, rows in items]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // ALIGN) * ALIGN)
    device = next((t.device for t, _ in items if t.is_cuda), None)
    buf = torch.empty(starts[-1], dtype=torch.uint8, pin_memory=device is not None)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # the pages as the engine's steps left them
    out = []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for (t, rows), size, start in zip(items, sizes, starts):
            part = buf[start : start + size]
            if size:
                dst = part.view(t.dtype).view(len(rows), *t.shape[1:])
                for src, at, n in page_runs(rows, range(len(rows))):
                    dst[at : at + n].copy_(t[src : src + n], non_blocking=device is not None)
            out.append(part)
    if device is not None and stream is None:  # done before the buffers are sent
        torch.cuda.current_stream(device).synchronize()
    return out


def _byte_view(buf: torch.Tensor | bytes | memoryview) -> torch.Tensor:
    """``buf`` as a uint8 tensor over the same memory (read only here; never copied)."""
    if isinstance(buf, torch.Tensor):
        return buf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer (a received frame): only read from
        return torch.frombuffer(buf, dtype=torch.uint8)


def unpack_request_state(cache: Caches, block_ids: list[int], slot: int | None,
                         buffers: list[torch.Tensor | bytes | memoryview]) -> None:
    """Write buffers packed by ``pack_request_state`` (same layout) into this cache's blocks and slot: one copy
    per run of consecutive blocks, straight from the buffer (host to device on a GPU)."""
    items = list(cache_tensors(cache))
    if len(buffers) != len(items):
        raise LayoutMismatch(f"{len(buffers)} buffers for {len(items)} described tensors")
    for (kind, layer, t), buf in zip(items, buffers):
        rows = _rows(kind, block_ids, slot)
        size = buf.numel() if isinstance(buf, torch.Tensor) else memoryview(buf).nbytes
        want = len(rows) * row_bytes(t)
        if size != want:
            raise LayoutMismatch(f"{kind}[{layer}]: {size} bytes, expected {want}")
        if not want:
            continue
        src = _byte_view(buf).view(t.dtype).view(len(rows), *t.shape[1:])
        for at, dst, n in page_runs(range(len(rows)), rows):
            t[dst : dst + n].copy_(src[at : at + n])
