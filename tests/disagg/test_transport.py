import time

import pytest
import torch

from flashinfra.disagg.layout import RequestState, describe, pack_request_state, unpack_request_state
from flashinfra.disagg.transport import StateReceiver, StateSender, TransferError
from tests.disagg.test_layout import _cache


def _wait(poll, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while True:
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
        tx.send(rx.address, _state(), lambda: pack_request_state(src, [5, 1, 3], slot=2))
        (arrival,) = _wait(rx.poll)
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
