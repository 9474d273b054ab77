"""The Mooncake data plane (TCP on the loopback) behind the transport's interface: the decode side reads a
request's pages and slot from the prefill side's registered cache straight into its own, in one batch of
page runs, with nothing packed or staged on either side; skipped where the ``mooncake-transfer-engine``
package (or ``mooncake-transfer-engine-non-cuda``) is not installed or does not load."""

import pytest
import torch

pytest.importorskip("mooncake.engine", exc_type=ImportError)  # also where its RDMA libraries do not load

from flashinfra.disagg.layout import RequestPages, describe  # noqa: E402
from flashinfra.disagg.mooncake import MooncakeReceiver, MooncakeSender  # noqa: E402
from flashinfra.disagg.transport import StateReceiver  # noqa: E402
from tests.disagg.test_layout import _cache  # noqa: E402
from tests.disagg.test_transport import _state, _wait  # noqa: E402


class _RecordingEngine:
    """A transfer engine that records its batch reads."""

    def __init__(self, engine) -> None:
        self.engine, self.reads = engine, []

    def batch_transfer_sync_read(self, *args):
        self.reads.append(args)
        return self.engine.batch_transfer_sync_read(*args)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_loopback_transfer_reads_the_cache_in_place(monkeypatch):
    src, dst = _cache(seed=1), _cache(seed=2)
    untouched = {k: {i: t.clone() for i, t in getattr(dst, k).items()} for k in ("mla_latent", "conv_state")}
    rx = MooncakeReceiver(describe(dst, "fp", "decode"), dst)
    tx = MooncakeSender(describe(src, "fp", "prefill"), src)
    recording = _RecordingEngine(rx._mem.engine)
    monkeypatch.setattr(rx._mem, "engine", recording)
    try:
        tx.send(rx.address, _state(), RequestPages(src, [5, 6, 1, 3], slot=2))
        (arrival,) = _wait(rx.poll, sender=tx)
        assert arrival.state == _state() and arrival.buffers == []  # only the header came over ZeroMQ
        rx.read(arrival, dst, [0, 1, 7, 4], slot=1)
        assert _wait(rx.poll_reads, sender=tx) == [("r1", None)]
        rx.ack(arrival.peer, arrival.state.request_id)
        assert _wait(tx.poll) == [("r1", None)]
        for kind in ("mla_latent", "indexer_keys"):
            for a, b in zip(getattr(src, kind).values(), getattr(dst, kind).values()):
                assert torch.equal(a[[5, 6, 1, 3]], b[[0, 1, 7, 4]])
        assert torch.equal(src.recurrent_state[1][2], dst.recurrent_state[1][1])
        assert torch.equal(src.conv_state[1][2], dst.conv_state[1][1])
        for i, t in dst.mla_latent.items():  # blocks and slots the request does not own are not written
            assert torch.equal(t[[2, 3, 5, 6]], untouched["mla_latent"][i][[2, 3, 5, 6]])
        assert torch.equal(dst.conv_state[1][[0, 2]], untouched["conv_state"][1][[0, 2]])
        # one batch: per paged tensor the runs 5-6 -> 0-1, 1 -> 7, 3 -> 4 (three), per slotted tensor one row,
        # every local address inside the decode cache's own tensors
        ((_, local, peer, lengths),) = recording.reads
        assert len(local) == 3 * 3 + 2
        row = src.mla_latent[0][0].numel() * 4
        base, pbase = dst.mla_latent[0].data_ptr(), src.mla_latent[0].data_ptr()
        assert (local[0], peer[0], lengths[0]) == (base, pbase + 5 * row, 2 * row)
    finally:
        tx.close()
        rx.close()


def test_a_zeromq_only_receiver_refuses_a_mooncake_sender_at_the_handshake():
    cache = _cache()
    rx = StateReceiver(describe(cache, "fp", "decode"))
    tx = MooncakeSender(describe(cache, "fp", "prefill"), cache)
    try:
        tx.send(rx.address, _state(), RequestPages(cache, [1, 2, 3], slot=0))
        ((rid, error),) = _wait(tx.poll)
        assert rid == "r1" and "with --transfer-backend mooncake, decode with zmq" in error
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("speculative_tokens", [0, 2], ids=["plain", "speculative"])
def test_engines_exchange_through_mooncake(tmp_path, speculative_tokens):
    from tests.disagg.test_roles import exchange_equals_one_engine

    exchange_equals_one_engine(tmp_path, transfer_backend="mooncake", speculative_tokens=speculative_tokens)


class _SlowEngine(_RecordingEngine):
    def batch_transfer_sync_read(self, *args):
        import time

        time.sleep(0.5)
        return super().batch_transfer_sync_read(*args)


def test_a_request_aborted_during_its_read_frees_its_blocks_when_the_read_is_over(tmp_path, monkeypatch):
    from flashinfra.engine.core import EngineCore
    from flashinfra.engine.sched.messages import SamplingParams, TransferParams
    from flashinfra.model.factory import write_tiny_checkpoint
    from tests.disagg.test_roles import PROMPTS, _config, _finished, _request, _run

    ckpt = write_tiny_checkpoint(tmp_path / "m", seed=0, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])
    prefill, decode = (EngineCore(_config(ckpt, role=role, transfer_backend="mooncake"))
                       for role in ("prefill", "decode"))
    try:
        monkeypatch.setattr(decode.disagg.receiver._mem, "engine", _SlowEngine(decode.disagg.receiver._mem.engine))
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        decode.add_request(_request("a", PROMPTS[1], sampling, TransferParams("t", "import")))
        prefill.add_request(_request("a", PROMPTS[1], sampling,
                                     TransferParams("t", "export", decode.ready_message().transfer_address)))
        _run([prefill, decode], lambda _: bool(decode.disagg._reading))
        stats = decode.stats()
        assert stats.num_blocks_free < stats.num_blocks_total  # taken for the read, outside the batch
        assert not decode.scheduler.running
        decode.abort(["a"])
        got = _run([prefill, decode], _finished(["a"]), errors_ok=True)[-1]
        assert got["a"][-1].finish_reason == "abort"
        out = _run([decode, prefill], _finished(["a"]), errors_ok=True)[-1]["a"][-1]
        assert out.finish_reason == "error" and "aborted on the decode engine" in out.error
        assert not decode.disagg._reading and decode.disagg.receiver.num_reads == 1
        for core in (prefill, decode):
            assert core.stats().num_blocks_free == core.stats().num_blocks_total
    finally:
        prefill.close()
        decode.close()
