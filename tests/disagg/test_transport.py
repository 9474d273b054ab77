import threading
import time

import pytest
import torch
import zmq

from flashinfra.disagg import transport
from flashinfra.disagg.layout import RequestPages, RequestState, describe, pack_request_state, unpack_request_state
from flashinfra.disagg.transport import StateReceiver, StateSender, TransferError
from tests.disagg.test_layout import _cache


def _wait(poll, timeout_s=10.0, sender=None):
    """What ``poll`` gives, once it gives something; ``sender`` (a ``StateSender``, which has no thread) is
    polled meanwhile, as its engine loop would between steps, and must finish nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        if sender is not None:
            assert sender.poll() == []
        got = poll()
        if got:
            return got
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.005)


def _state(rid="r1"):
    return RequestState(rid, prompt_len=10, num_blocks=3, first_token=7, generator_state=b"\x01\x02")


def test_loopback_transfer_and_ack():
    src, dst = _cache(seed=1), _cache(seed=2)
    rx = StateReceiver(describe(dst, "fp", "decode"))
    tx = StateSender(describe(src, "fp", "prefill"))
    try:
        tx.send(rx.address, _state(), RequestPages(src, [5, 1, 3], slot=2))
        (arrival,) = _wait(rx.poll, sender=tx)
        assert arrival.state == _state()
        unpack_request_state(dst, [0, 7, 4], slot=1, buffers=arrival.buffers)
        assert tx.num_outstanding == 1
        rx.ack(arrival.peer, arrival.state.request_id)
        assert _wait(tx.poll) == [("r1", None)] and tx.num_outstanding == 0
        assert torch.equal(src.mla_latent[2][[5, 1, 3]], dst.mla_latent[2][[0, 7, 4]])
        assert torch.equal(src.indexer_keys[0][[5, 1, 3]], dst.indexer_keys[0][[0, 7, 4]])
        assert torch.equal(src.recurrent_state[1][2], dst.recurrent_state[1][1])
        assert torch.equal(src.conv_state[1][2], dst.conv_state[1][1])
    finally:
        tx.close()
        rx.close()


def test_handshake_refuses_mismatch_by_name():
    rx = StateReceiver(describe(_cache(), "fp", "decode@B"))
    tx = StateSender(describe(_cache(dtype=torch.bfloat16), "fp", "prefill@A"))
    try:
        tx.send(rx.address, _state(), [])
        ((rid, error),) = _wait(tx.poll)
        assert rid == "r1" and "cache layout mismatch between decode@B and prefill@A" in error
        assert not rx.poll()
    finally:
        tx.close()
        rx.close()


def test_unacknowledged_transfer_times_out_and_the_queue_is_bounded():
    cache = _cache()
    rx = StateReceiver(describe(cache, "fp", "decode"))
    tx = StateSender(describe(cache, "fp", "prefill"), timeout_s=0.5, max_inflight=1)
    try:
        start = time.monotonic()
        tx.send(rx.address, _state(), pack_request_state(cache, [1, 2, 3], slot=0))
        with pytest.raises(TransferError, match="at most 1"):
            tx.send(rx.address, _state("r2"), [])
        ((rid, error),) = _wait(tx.poll)
        assert rid == "r1" and "did not acknowledge the transfer within 0.5 s" in error
        assert time.monotonic() - start < 5
        tx.send(rx.address, _state("r3"), pack_request_state(cache, [1, 2, 3], slot=0))  # room again
    finally:
        tx.close()
        rx.close()


def _drive(tx, receivers, until, timeout_s=10.0):
    """Be the engine loop: sleep on the sender's sockets until its next deadline, poll it; serve ``receivers``
    (address -> what to do with an arrival) meanwhile. The results, once ``until`` holds for them."""
    got = {}
    deadline = time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, f"no progress: {got}"
        poller = zmq.Poller()
        for sock in tx.wait_sockets():
            poller.register(sock, zmq.POLLIN)
        wake = tx.next_deadline()
        poller.poll(10 if wake is None else min(10, max(0, int((wake - time.monotonic()) * 1000) + 1)))
        for rx, handle in receivers:
            for arrival in rx.poll():
                handle(rx, arrival)
        got.update(tx.poll())
    return got


def test_a_sender_has_no_thread_and_its_owner_drives_every_outcome(monkeypatch):
    """Every socket of a sender is its owner's: no thread is started, and polling from the owner's thread
    alone completes a transfer, refuses a mismatched layout (and every later transfer there at once), fails the
    transfers of a receiver that dies at once, one never acknowledged at its timeout, and one to an engine that
    never answers the handshake at the handshake's timeout."""
    monkeypatch.setattr(transport, "HANDSHAKE_TIMEOUT_S", 0.5)
    src = _cache(seed=1)
    layout = describe(src, "fp", "prefill")
    good, dying, silent = (StateReceiver(describe(_cache(), "fp", "decode")) for _ in range(3))
    other = StateReceiver(describe(_cache(dtype=torch.bfloat16), "fp", "decode@B"))
    mute = zmq.Context.instance().socket(zmq.ROUTER)  # takes the handshake, never answers it
    mute.setsockopt(zmq.LINGER, 0)
    mute.bind("tcp://127.0.0.1:*")
    mute_address = mute.getsockopt(zmq.LAST_ENDPOINT).decode()
    threads = set(threading.enumerate())
    tx = StateSender(layout, timeout_s=1.0)
    try:
        pages = RequestPages(src, [5, 1, 3], slot=2)
        for rid, rx in (("ok", good), ("mismatch", other), ("dead", dying), ("silent", silent)):
            tx.send(rx.address, _state(rid), pages)
        tx.send(mute_address, _state("mute"), pages)
        assert set(threading.enumerate()) == threads and tx.num_outstanding == 5

        def die(rx, arrival):
            rx.close()  # the decode engine goes away with the transfer unacknowledged

        start = time.monotonic()
        got = _drive(tx, [(good, lambda rx, a: rx.ack(a.peer, a.state.request_id)), (dying, die),
                          (silent, lambda rx, a: None)],
                     lambda got: {"ok", "mismatch", "dead"} <= got.keys())
        assert got["ok"] is None and time.monotonic() - start < 1.0
        assert "refused by the decode engine at" in got["mismatch"]
        assert "cache layout mismatch between decode@B and prefill" in got["mismatch"]
        assert "went away during the transfer" in got["dead"]
        tx.send(other.address, _state("again"), pages)  # refused at once, with the same message
        assert tx.has_events() and tx.poll() == [("again", got["mismatch"])]
        got = _drive(tx, [], lambda got: {"silent", "mute"} <= got.keys())
        assert "did not acknowledge the transfer within 1 s" in got["silent"]
        assert f"no answer from the decode engine at {mute_address}" in got["mute"]
        assert set(threading.enumerate()) <= threads and tx.num_outstanding == 0  # one receiver's has ended
        assert not tx.has_events() and tx.next_deadline() is None
    finally:
        tx.close()
        for rx in (good, silent, other):
            rx.close()
        mute.close()


@pytest.mark.gpu
def test_a_gpu_cache_is_packed_on_a_side_stream_and_sent_once_the_copy_is_over():
    """The pages are copied after the work queued on the engine's stream (here a write still running when the
    transfer starts), by a stream of the sender's own; the state goes out from a later poll, whole."""
    from tests.disagg.test_ipc import _on

    src, dst = _on(_cache(seed=1), "cuda"), _cache(seed=2)
    rx = StateReceiver(describe(dst, "fp", "decode"))
    tx = StateSender(describe(src, "fp", "prefill"))
    try:
        torch.cuda._sleep(200_000_000)  # the engine's stream busy for a while (about 0.1 s)
        src.mla_latent[2][5].fill_(3)  # written after it: the state must carry this
        tx.send(rx.address, _state(), RequestPages(src, [5, 1, 3], slot=2))
        assert tx.next_deadline() is not None  # the handshake and the copy are awaited
        (arrival,) = _wait(rx.poll, sender=tx)
        unpack_request_state(dst, [0, 7, 4], slot=1, buffers=arrival.buffers)
        rx.ack(arrival.peer, arrival.state.request_id)
        assert _wait(tx.poll) == [("r1", None)]
        assert torch.equal(src.mla_latent[2][[5, 1, 3]].cpu(), dst.mla_latent[2][[0, 7, 4]])
        assert bool((dst.mla_latent[2][0] == 3).all())
        assert torch.equal(src.recurrent_state[1][2].cpu(), dst.recurrent_state[1][1])
    finally:
        tx.close()
        rx.close()
