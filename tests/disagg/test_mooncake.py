"""The Mooncake data plane (TCP on the loopback) behind the transport's interface; skipped where the
``mooncake-transfer-engine`` package is not installed."""

import pytest
import torch

pytest.importorskip("mooncake.engine")

from flashinfra.disagg.layout import describe, pack_request_state, unpack_request_state  # noqa: E402
from flashinfra.disagg.mooncake import MooncakeReceiver, MooncakeSender  # noqa: E402
from flashinfra.disagg.transport import StateReceiver  # noqa: E402
from tests.disagg.test_layout import _cache  # noqa: E402
from tests.disagg.test_transport import _state, _wait  # noqa: E402


def test_loopback_transfer_through_mooncake():
    src, dst = _cache(seed=1), _cache(seed=2)
    rx = MooncakeReceiver(describe(dst, "fp", "decode"))
    tx = MooncakeSender(describe(src, "fp", "prefill"))
    try:
        tx.send(rx.address, _state(), lambda: pack_request_state(src, [5, 1, 3], slot=2))
        (arrival,) = _wait(rx.poll)
        assert arrival.state == _state()
        unpack_request_state(dst, [0, 7, 4], slot=1, buffers=arrival.buffers)
        rx.ack(arrival.peer, arrival.state.request_id)
        assert _wait(tx.poll) == [("r1", None)]
        assert not tx._registered  # the sender let go of its buffers after the ack
        for kind in ("mla_latent", "indexer_keys"):
            for a, b in zip(getattr(src, kind).values(), getattr(dst, kind).values()):
                assert torch.equal(a[[5, 1, 3]], b[[0, 7, 4]])
        assert torch.equal(src.recurrent_state[1][2], dst.recurrent_state[1][1])
        assert torch.equal(src.conv_state[1][2], dst.conv_state[1][1])
    finally:
        tx.close()
        rx.close()


def test_a_zeromq_only_receiver_refuses_a_mooncake_transfer():
    cache = _cache()
    rx = StateReceiver(describe(cache, "fp", "decode"))
    tx = MooncakeSender(describe(cache, "fp", "prefill"))
    try:
        tx.send(rx.address, _state(), pack_request_state(cache, [1, 2, 3], slot=0))
        ((rid, error),) = _wait(tx.poll)
        assert rid == "r1" and "no Mooncake transport" in error
    finally:
        tx.close()
        rx.close()


def test_engines_exchange_through_mooncake(tmp_path):
    from flashinfra.engine.core import EngineCore
    from flashinfra.engine.sched.messages import SamplingParams, TransferParams
    from flashinfra.model.factory import write_tiny_checkpoint
    from tests.disagg.test_roles import PROMPTS, _config, _finished, _request, _run, _tokens

    ckpt = write_tiny_checkpoint(tmp_path / "m", seed=0, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])
    cores = [EngineCore(_config(ckpt, **kw)) for kw in ({}, {"role": "prefill", "transfer_backend": "mooncake"},
                                                        {"role": "decode", "transfer_backend": "mooncake"})]
    both, prefill, decode = cores
    try:
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        both.add_request(_request("a", PROMPTS[1], sampling))
        want = _run([both], _finished(["a"]))[-1]
        decode.add_request(_request("a", PROMPTS[1], sampling, TransferParams("t", "import")))
        prefill.add_request(_request("a", PROMPTS[1], sampling,
                                     TransferParams("t", "export", decode.ready_message().transfer_address)))
        got = _run([prefill, decode], _finished(["a"]))[-1]
        assert _tokens(got["a"]) == _tokens(want["a"])
    finally:
        for core in cores:
            core.close()
