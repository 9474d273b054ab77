import threading
import time

import pytest
import torch

from flashinfra.disagg.layout import LayoutMismatch, RequestState, describe, pack_request_state, unpack_request_state
from flashinfra.disagg.transport import StateReceiver, StateSender
from tests.disagg.test_layout import _cache


def test_loopback_transfer_and_ack():
    src, dst = _cache(seed=1), _cache(seed=2)
    rx = StateReceiver(describe(dst, "fp", "decode"))
    acked = threading.Event()
    got = []
    t = threading.Thread(target=lambda: got.append(rx.recv(timeout_ms=5000)), daemon=True)
    t.start()  # serves the handshake, then waits for the state
    tx = StateSender(describe(src, "fp", "prefill"), rx.address, on_ack=lambda rid: acked.set())
    try:
        tx.send(RequestState("r1", prompt_len=10, num_blocks=3, first_token=7, sampling={"temperature": 0.0}),
                pack_request_state(src, [5, 1, 3], slot=2))
        t.join(5)
        peer, state, bufs = got[0]
        assert state.request_id == "r1" and state.first_token == 7
        unpack_request_state(dst, [0, 7, 4], slot=1, buffers=bufs)
        rx.ack(peer, state.request_id)
        assert acked.wait(5) and not tx.inflight and not tx.errors
        assert torch.equal(src.mla_latent[2][[5, 1, 3]], dst.mla_latent[2][[0, 7, 4]])
        assert torch.equal(src.recurrent_state[1][2], dst.recurrent_state[1][1])
    finally:
        tx.close()
        rx.close()


def test_handshake_refuses_mismatch():
    rx = StateReceiver(describe(_cache(), "fp", "decode@B"))
    t = threading.Thread(target=rx.recv, kwargs={"timeout_ms": 3000}, daemon=True)
    t.start()
    try:
        with pytest.raises(LayoutMismatch, match="between decode@B and prefill@A"):
            StateSender(describe(_cache(dtype=torch.bfloat16), "fp", "prefill@A"), rx.address, timeout_s=3)
    finally:
        t.join(4)
        rx.close()
