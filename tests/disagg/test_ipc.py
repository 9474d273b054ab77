"""The mapped-memory data plane (``--transfer-backend ipc``): the decode side maps the prefill side's cache
at the handshake and copies a request's page runs and slot from it straight into its own cache, nothing
packed or sent as frames; across two processes (shared memory on the CPU, CUDA IPC on a GPU), within one,
and between two engines (greedy tokens equal one engine's, with and without speculation)."""

import subprocess
import sys
import textwrap

import pytest
import torch

from flashinfra.disagg.ipc import IpcReceiver, IpcSender
from flashinfra.disagg.layout import RequestPages, describe
from flashinfra.disagg.transport import StateReceiver
from tests.disagg.test_layout import _cache
from tests.disagg.test_transport import _state, _wait

SRC_BLOCKS, DST_BLOCKS = [5, 6, 1, 3], [0, 1, 7, 4]


def _on(cache, device: str):
    for kind in ("mla_latent", "indexer_keys", "conv_state", "recurrent_state"):
        getattr(cache, kind).update({i: t.to(device) for i, t in getattr(cache, kind).items()})
    return cache


def _check_copied(src, dst, untouched) -> None:
    for kind in ("mla_latent", "indexer_keys"):
        for a, b in zip(getattr(src, kind).values(), getattr(dst, kind).values()):
            assert torch.equal(a[SRC_BLOCKS].cpu(), b[DST_BLOCKS].cpu())
    assert torch.equal(src.recurrent_state[1][2].cpu(), dst.recurrent_state[1][1].cpu())
    assert torch.equal(src.conv_state[1][2].cpu(), dst.conv_state[1][1].cpu())
    for i, t in dst.mla_latent.items():  # blocks and slots the request does not own are not written
        assert torch.equal(t[[2, 3, 5, 6]].cpu(), untouched["mla_latent"][i][[2, 3, 5, 6]])
    assert torch.equal(dst.conv_state[1][[0, 2]].cpu(), untouched["conv_state"][1][[0, 2]])


def _receive(rx: IpcReceiver, dst, tx: IpcSender | None = None) -> None:
    """Take the state, read it, ack it; ``tx``: the sender, when in this process (polled meanwhile)."""
    (arrival,) = _wait(rx.poll, sender=tx)
    assert arrival.state == _state() and arrival.buffers == []  # only the header came over ZeroMQ
    rx.read(arrival, dst, DST_BLOCKS, slot=1)
    assert _wait(rx.poll_reads, sender=tx) == [("r1", None)]
    rx.ack(arrival.peer, arrival.state.request_id)


def test_one_process_copies_the_runs_from_the_mapped_cache():
    src, dst = _cache(seed=1), _cache(seed=2)
    before = src.mla_latent[0].clone()
    untouched = {k: {i: t.clone() for i, t in getattr(dst, k).items()} for k in ("mla_latent", "conv_state")}
    rx = IpcReceiver(describe(dst, "fp", "decode"), dst)
    tx = IpcSender(describe(src, "fp", "prefill"), src)
    try:
        assert torch.equal(src.mla_latent[0], before)  # moved into shared memory, same values
        tx.send(rx.address, _state(), RequestPages(src, SRC_BLOCKS, slot=2))
        _receive(rx, dst, tx)
        assert _wait(tx.poll) == [("r1", None)]
        _check_copied(src, dst, untouched)
        assert rx.num_reads == 1
    finally:
        tx.close()
        rx.close()


SENDER = textwrap.dedent("""
    import sys, torch
    from flashinfra.disagg.ipc import IpcSender
    from flashinfra.disagg.layout import RequestPages, describe
    from tests.disagg.test_ipc import SRC_BLOCKS, _on
    from tests.disagg.test_layout import _cache
    from tests.disagg.test_transport import _state, _wait

    src = _on(_cache(seed=1), sys.argv[2])
    tx = IpcSender(describe(src, "fp", "prefill"), src)
    tx.send(sys.argv[1], _state(), RequestPages(src, SRC_BLOCKS, slot=2))
    print(_wait(tx.poll, 60)[0][1])
    tx.close()
""")


def _across_processes(device: str) -> None:
    dst = _on(_cache(seed=2), device)
    untouched = {k: {i: t.cpu().clone() for i, t in getattr(dst, k).items()} for k in ("mla_latent", "conv_state")}
    rx = IpcReceiver(describe(dst, "fp", "decode"), dst)
    try:
        sender = subprocess.Popen([sys.executable, "-c", SENDER, rx.address, device], stdout=subprocess.PIPE,
                                  text=True)
        _receive(rx, dst)
        out, _ = sender.communicate(timeout=60)
        assert sender.returncode == 0 and out.strip() == "None", out  # the sender got the ack, no error
        _check_copied(_cache(seed=1), dst, untouched)
    finally:
        rx.close()


def test_a_decode_process_copies_from_a_prefill_process_shared_memory():
    _across_processes("cpu")


@pytest.mark.gpu
def test_a_decode_process_copies_from_a_prefill_process_by_cuda_ipc():
    _across_processes("cuda")


def test_a_zeromq_receiver_refuses_an_ipc_sender_at_the_handshake():
    cache = _cache()
    rx = StateReceiver(describe(cache, "fp", "decode"))
    tx = IpcSender(describe(cache, "fp", "prefill"), cache)
    try:
        tx.send(rx.address, _state(), RequestPages(cache, [1, 2, 3], slot=0))
        ((rid, error),) = _wait(tx.poll)
        assert rid == "r1" and "with --transfer-backend ipc, decode with zmq" in error
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("speculative_tokens", [0, 2], ids=["plain", "speculative"])
def test_engines_exchange_through_mapped_memory(tmp_path, speculative_tokens):
    from tests.disagg.test_roles import exchange_equals_one_engine

    exchange_equals_one_engine(tmp_path, transfer_backend="ipc", speculative_tokens=speculative_tokens)


def test_a_cpu_cache_larger_than_the_free_shared_memory_is_refused(monkeypatch):
    import os

    from flashinfra.disagg.transport import TransferError

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    cache = _cache()
    with pytest.raises(TransferError, match=r"MiB free"):
        IpcSender(describe(cache, "fp", "prefill"), cache)


def test_an_idle_senders_cache_is_unmapped_and_mapped_again_on_use(monkeypatch):
    """A restarted prefill engine shares a new cache under a new session: the old one, idle, is unmapped (its
    memory no longer held here) and mapped again when a transfer names it."""
    from flashinfra.disagg import ipc

    monkeypatch.setattr(ipc, "IDLE_UNMAP_S", 0.0)
    first, second, dst = _cache(seed=1), _cache(seed=3), _cache(seed=2)
    rx = IpcReceiver(describe(dst, "fp", "decode"), dst)
    senders = [IpcSender(describe(c, "fp", "prefill"), c) for c in (first, second)]
    try:
        for tx, src in (*zip(senders, (first, second)), (senders[0], first)):
            untouched = {k: {i: t.clone() for i, t in getattr(dst, k).items()} for k in ("mla_latent", "conv_state")}
            tx.send(rx.address, _state(), RequestPages(src, SRC_BLOCKS, slot=2))
            _receive(rx, dst, tx)
            assert _wait(tx.poll) == [("r1", None)]
            _check_copied(src, dst, untouched)
            assert list(rx._mapped) == [tx.session]  # the other sender's cache is not held
        assert rx.num_reads == 3
    finally:
        for tx in senders:
            tx.close()
        rx.close()
