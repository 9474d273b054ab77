"""The bytes a ZeroMQ transfer copies, counted on each side with a dispatch mode (every tensor op that writes
memory; views and allocations are free) and ``tracemalloc`` (Python-level copies): the prefill side copies
each byte of the request's state once, straight from the cache into one buffer that every frame is a view
of (one copy per run of consecutive blocks); the decode side copies each byte once, straight from the
received frames into its cache, with no Python-level copy of them."""

import tracemalloc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashinfra.disagg.layout import RequestPages, describe, row_bytes, unpack_request_state
from flashinfra.model.cache import ModelCache
from flashinfra.disagg.transport import StateReceiver, StateSender
from tests.disagg.test_layout import _cache
from tests.disagg.test_transport import _state, _wait


class _Copies(TorchDispatchMode):
    """Counts the tensor ops that write memory under it, and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if func.is_view or "empty" in name or name.startswith("aten::_local_scalar"):
            return out
        written = args[1] if name == "aten::copy_" else args[3] if name == "aten::index_copy_" else out
        if isinstance(written, torch.Tensor):
            self.calls += 1
            self.bytes += written.numel() * written.element_size()
        return out


def test_each_side_copies_every_byte_once():
    src, dst = _cache(blocks=64, width=2048, seed=1), _cache(blocks=64, width=2048, seed=2)
    blocks, slot = [9, 10, 11, 12, 40, 41, 3], 2  # three runs of consecutive blocks
    to = [0, 1, 2, 3, 4, 5, 6]  # one run
    state_bytes = sum(len(blocks) * row_bytes(t) for t in (*src.mla_latent.values(), *src.indexer_keys.values()))
    state_bytes += sum(row_bytes(t) for t in (*src.conv_state.values(), *src.recurrent_state.values()))
    rx = StateReceiver(describe(dst, "fp", "decode"))
    tx = StateSender(describe(src, "fp", "prefill"))
    sent = _Copies()
    try:
        with sent:  # a CPU cache: packed on the caller's thread, as it sends
            packed = RequestPages(src, blocks, slot)()
        tx.send(rx.address, _state(), packed)
        (arrival,) = _wait(rx.poll, sender=tx)
        received = _Copies()
        tracemalloc.start()
        with received:
            rx.write(arrival, dst, to, 1)
        _, python_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rx.ack(arrival.peer, arrival.state.request_id)
        assert _wait(tx.poll) == [("r1", None)]
    finally:
        tx.close()
        rx.close()
    assert sent.bytes == state_bytes and sent.calls == 3 * 3 + 2  # 3 runs per paged tensor, 1 per slotted one
    assert len({b.untyped_storage().data_ptr() for b in packed}) == 1  # one send buffer, each frame a view of it
    assert received.bytes == state_bytes and received.calls == 3 + 2  # 1 run per paged tensor, 1 per slotted one
    largest = len(blocks) * row_bytes(src.mla_latent[0])
    assert python_peak < largest // 8  # the frames were read in place, never copied into Python objects
    for kind in ("mla_latent", "indexer_keys"):
        for a, b in zip(getattr(src, kind).values(), getattr(dst, kind).values()):
            assert torch.equal(a[blocks], b[to])
    assert torch.equal(src.conv_state[1][slot], dst.conv_state[1][1])
    assert torch.equal(src.recurrent_state[1][slot], dst.recurrent_state[1][1])


@pytest.mark.gpu
def test_a_gpu_cache_is_packed_into_pinned_memory_and_unpacked_straight_back():
    def cache(seed):
        g = torch.Generator().manual_seed(seed)
        r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=g).to(dt).cuda()  # noqa: E731
        return ModelCache(block_size=16, num_blocks=64, num_slots=4, mla_latent={0: r(64, 16, 512), 2: r(64, 16, 512)},
                          indexer_keys={0: r(64, 16, 256)}, conv_state={1: r(4, 9, 3, dt=torch.float32)},
                          recurrent_state={1: r(4, 2, 128, 128, dt=torch.float32)},
                          mla_latent_scale={2: r(64, 16, dt=torch.float32)})

    src, dst = cache(1), cache(2)
    blocks, to = [9, 10, 11, 40, 3], [5, 6, 7, 8, 0]
    sent, received = _Copies(), _Copies()
    with sent:
        bufs = RequestPages(src, blocks, 2)()
    assert all(b.is_pinned() and b.device.type == "cpu" for b in bufs)
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1 and sent.calls == 3 * 4 + 2
    with received:
        unpack_request_state(dst, to, 1, [b.numpy().tobytes() for b in bufs])  # frames as received
    assert received.calls == 2 * 4 + 2 and received.bytes == sent.bytes
    for kind in ("mla_latent", "indexer_keys", "mla_latent_scale"):
        for a, b in zip(getattr(src, kind).values(), getattr(dst, kind).values()):
            assert torch.equal(a[blocks], b[to])
    assert torch.equal(src.conv_state[1][2], dst.conv_state[1][1])
    assert torch.equal(src.recurrent_state[1][2], dst.recurrent_state[1][1])
