"""A prefill-role and a decode-role ``EngineCore`` in one process, exchanging request states over the ZeroMQ
transport on the loopback: outputs equal a single engine's (greedy and seeded sampling), the prefill side
frees its blocks after the ack, after a timeout, or at once when the receiving process is killed, a mismatched
layout is refused by name, the first token's logprobs reach the decode side."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import msgspec

import pytest

from flashinfra.disagg.transport import StateReceiver
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams, TransferParams
from flashinfra.model.factory import write_tiny_checkpoint

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 250, 31], list(range(40, 77)), [300, 2, 2, 9]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("model"), seed=0, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"])


def _config(ckpt, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), device="cpu", num_blocks=48, block_size=4, max_num_seqs=4,
                        prefix_cache_slots=0, **kw)


def _request(rid, prompt, sampling, transfer=None) -> EngineRequest:
    return EngineRequest(rid, list(prompt), sampling, time.time(), transfer=transfer)


def _run(cores, until, timeout_s=120.0, got=None, errors_ok=False) -> list[dict[str, list]]:
    """Step every core until ``until`` holds for the last core's outputs; every core's, by request id
    (added to ``got``, when given)."""
    got = got if got is not None else [{} for _ in cores]
    deadline = time.monotonic() + timeout_s
    while not until(got[-1]):
        assert time.monotonic() < deadline, f"no progress: {got}"
        idle = True
        for core, mine in zip(cores, got):
            if core.has_work():
                idle = False
                for out in core.step():
                    mine.setdefault(out.request_id, []).append(out)
                    assert errors_ok or out.finish_reason != "error", out.error
        if idle:
            time.sleep(0.002)
    return got


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _finished(ids):
    return lambda got: all(i in got and got[i][-1].finished for i in ids)


def two_layer_mtp_checkpoint(path):
    """A KDA layer and an MLA layer (dense, then sparse MLP) and an MTP layer."""
    return write_tiny_checkpoint(path, seed=0, num_hidden_layers=2,
                                 layer_types=["linear_attention", "indexed_attention"],
                                 mlp_layer_types=["dense", "sparse"], indexer_types=["full", "full"],
                                 num_nextn_predict_layers=1)


def exchange_equals_one_engine(tmp_path, **kw) -> None:
    """A prefill and a decode engine moving states with ``kw`` (``transfer_backend``, ``speculative_tokens``)
    give one engine's greedy tokens, every state copied from the sender's cache in place."""
    ckpt = two_layer_mtp_checkpoint(tmp_path / "m")
    cores = [EngineCore(_config(ckpt, **c)) for c in ({}, {"role": "prefill", **kw}, {"role": "decode", **kw})]
    both, prefill, decode = cores
    try:
        sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            both.add_request(_request(rid, prompt, sampling))
        want = _run([both], _finished(ids))[-1]
        peer = decode.ready_message().transfer_address
        for rid, prompt in zip(ids, PROMPTS):
            decode.add_request(_request(rid, prompt, sampling, TransferParams(f"t-{rid}", "import")))
            prefill.add_request(_request(rid, prompt, sampling, TransferParams(f"t-{rid}", "export", peer)))
        got = _run([prefill, decode], _finished(ids))[-1]
        assert {r: _tokens(got[r]) for r in ids} == {r: _tokens(want[r]) for r in ids}
        assert decode.disagg.receiver.num_reads == len(ids)
    finally:
        for core in cores:
            core.close()


@pytest.fixture(scope="module")
def engines(ckpt):
    prefill = EngineCore(_config(ckpt, role="prefill", transfer_timeout_s=3.0))
    decode = EngineCore(_config(ckpt, role="decode"))
    both = EngineCore(_config(ckpt))
    yield prefill, decode, both
    for core in (prefill, decode, both):
        core.close()


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                                      SamplingParams(max_tokens=9, temperature=1.0, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_disaggregated_outputs_equal_a_single_engine(engines, sampling):
    prefill, decode, both = engines
    peer = decode.ready_message().transfer_address
    ids = [f"{sampling.temperature}-r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS):
        both.add_request(_request(rid, prompt, sampling))
    want = _run([both], _finished(ids))[-1]
    for rid, prompt in zip(ids, PROMPTS):
        decode.add_request(_request(rid, prompt, sampling, TransferParams(f"t-{rid}", "import")))
        prefill.add_request(_request(rid, prompt, sampling, TransferParams(f"t-{rid}", "export", peer)))
    got_prefill, got_decode = _run([prefill, decode], _finished(ids))
    assert {r: _tokens(got_decode[r]) for r in ids} == {r: _tokens(want[r]) for r in ids}
    assert all(len(_tokens(want[r])) == 9 for r in ids)
    # the prefill side answered once per request (its first token), after the ack, and freed every block
    _run([decode, prefill], _finished(ids), got=[got_decode, got_prefill])
    assert {r: _tokens(got_prefill[r]) for r in ids} == {r: _tokens(want[r])[:1] for r in ids}
    stats = prefill.stats()
    assert stats.num_transfers_held == 0 and stats.num_blocks_free == stats.num_blocks_total
    assert decode.stats().num_blocks_free == decode.stats().num_blocks_total


def test_unacknowledged_transfer_fails_and_frees_the_blocks(engines):
    prefill, decode, _ = engines
    silent = StateReceiver(decode.disagg.layout)  # accepts the handshake, never acknowledges
    silent.ack = lambda *a, **k: None
    try:
        prefill.add_request(_request("lost", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0),
                                     TransferParams("t-lost", "export", silent.address)))
        start = time.monotonic()
        while prefill.stats().num_transfers_held == 0:
            prefill.step()
        assert prefill.stats().num_blocks_free < prefill.stats().num_blocks_total
        got = _run([prefill], _finished(["lost"]), timeout_s=20, errors_ok=True)[-1]
        out = got["lost"][-1]
        assert out.finish_reason == "error" and "did not acknowledge the transfer within 3 s" in out.error
        assert time.monotonic() - start < 10
        stats = prefill.stats()
        assert stats.num_transfers_held == 0 and stats.num_blocks_free == stats.num_blocks_total
    finally:
        silent.close()


def test_a_state_that_arrived_before_its_request_is_imported_at_once(engines):
    """The state can beat its request to the decode engine (a chat template takes longer to apply than a short
    prefill to run): the request's arrival alone gives the loop work, and it decodes as it would otherwise."""
    prefill, decode, _ = engines
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    prefill.add_request(_request("early", PROMPTS[0], sampling,
                                 TransferParams("t-early", "export", decode.ready_message().transfer_address)))
    deadline = time.monotonic() + 20
    while "t-early" not in decode.disagg._arrived:
        assert time.monotonic() < deadline, "the state never arrived"
        prefill.step()
        decode.step()
    while decode.has_work():  # the receiver's wake of the arrival, drained: nothing left to step for
        assert time.monotonic() < deadline, "the decode engine kept work with no request"
        decode.step()
    decode.add_request(_request("early", PROMPTS[0], sampling, TransferParams("t-early", "import")))
    assert decode.has_work()  # the engine loop steps only an engine with work: this is what imports it
    got = _run([prefill, decode], _finished(["early"]), timeout_s=10)
    assert len(_tokens(got[-1]["early"])) == 4
    stats = prefill.stats()
    assert stats.num_transfers_held == 0 and stats.num_blocks_free == stats.num_blocks_total


def test_aborting_an_import_whose_state_arrived_answers_the_sender_at_once(engines):
    """A decode request aborted after its state arrived but before it was imported (the state came first, then the
    request, then the abort) is answered at once: the prefill side fails it with the reason and frees its blocks,
    without waiting out its transfer timeout."""
    prefill, decode, _ = engines
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    prefill.add_request(_request("gone", PROMPTS[0], sampling,
                                 TransferParams("t-gone", "export", decode.ready_message().transfer_address)))
    deadline = time.monotonic() + 20
    while "t-gone" not in decode.disagg._arrived:  # the state is in, no request waits for it yet
        assert time.monotonic() < deadline, "the state never arrived"
        prefill.step()
        decode.step()
    decode.add_request(_request("gone", PROMPTS[0], sampling, TransferParams("t-gone", "import")))
    decode.abort(["gone"])
    got = _run([prefill], _finished(["gone"]), timeout_s=20, errors_ok=True)[-1]
    out = got["gone"][-1]
    # the answer, not the prefill side's transfer timeout (3 s), which would say the state was not acknowledged
    assert out.finish_reason == "error" and "aborted on the decode engine" in out.error, out.error
    stats = prefill.stats()
    assert stats.num_transfers_held == 0 and stats.num_blocks_free == stats.num_blocks_total
    assert decode.stats().num_blocks_free == decode.stats().num_blocks_total


# a decode engine's receiving end that takes the handshake and the state, and never acknowledges
_SILENT_RECEIVER = """
import sys, time, msgspec
from flashinfra.disagg.layout import CacheLayout
from flashinfra.disagg.transport import StateReceiver
rx = StateReceiver(msgspec.json.decode(sys.stdin.buffer.read(), type=CacheLayout))
print(rx.address, flush=True)
while True:
    if rx.poll():
        print("arrived", flush=True)
    time.sleep(0.01)
"""


def test_killed_receiver_fails_the_transfer_at_once_and_frees_the_blocks(engines):
    prefill, decode, _ = engines
    proc = subprocess.Popen([sys.executable, "-c", _SILENT_RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        proc.stdin.write(msgspec.json.encode(decode.disagg.layout).decode())
        proc.stdin.close()
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), address
        prefill.add_request(_request("dead", PROMPTS[1], SamplingParams(max_tokens=4, temperature=0.0),
                                     TransferParams("t-dead", "export", address)))
        # the engine loop sends the state once the handshake is answered: step it until the receiver has it
        got = _run([prefill], lambda _: bool(select.select([proc.stdout], [], [], 0)[0]), errors_ok=True)
        assert proc.stdout.readline().strip() == "arrived" and prefill.stats().num_transfers_held > 0
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out = _run([prefill], _finished(["dead"]), timeout_s=20, errors_ok=True, got=got)[-1]["dead"][-1]
        assert time.monotonic() - killed_at < 1.5  # the transfer timeout is 3 s
        assert out.finish_reason == "error" and "went away during the transfer" in out.error
        stats = prefill.stats()
        assert stats.num_transfers_held == 0 and stats.num_blocks_free == stats.num_blocks_total
    finally:
        proc.kill()
        proc.wait(10)


def test_mismatched_layout_is_refused_with_both_names(engines, tmp_path):
    prefill, _, _ = engines
    other = EngineCore(_config(write_tiny_checkpoint(tmp_path / "other", seed=0, num_hidden_layers=3,
                                                     layer_types=["linear_attention", "indexed_attention",
                                                                  "linear_attention"],
                                                     mlp_layer_types=["dense", "sparse", "sparse"],
                                                     indexer_types=["full", "full", "full"]), role="decode"))
    try:
        prefill.add_request(_request("mm", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0),
                                     TransferParams("t-mm", "export", other.ready_message().transfer_address)))
        out = _run([prefill], _finished(["mm"]), errors_ok=True)[-1]["mm"][-1]
        assert out.finish_reason == "error"
        assert "refused by the decode engine" in out.error
        assert "cache layout mismatch between decode engine" in out.error
        assert "and prefill engine" in out.error
        assert prefill.stats().num_blocks_free == prefill.stats().num_blocks_total
    finally:
        other.close()


def test_roles_refuse_requests_of_the_other_kind(engines):
    prefill, decode, both = engines
    with pytest.raises(ValueError, match="only requests to export"):
        prefill.add_request(_request("x", PROMPTS[0], SamplingParams()))
    with pytest.raises(ValueError, match="only requests to import"):
        decode.add_request(_request("y", PROMPTS[0], SamplingParams()))
    with pytest.raises(ValueError, match="--role prefill or --role decode"):
        both.add_request(_request("z", PROMPTS[0], SamplingParams(), TransferParams("t", "import")))


def test_first_token_logprobs_move_with_the_request(engines):
    prefill, decode, both = engines
    peer = decode.ready_message().transfer_address
    sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)
    both.add_request(_request("lp", PROMPTS[0], sampling))
    want = _run([both], _finished(["lp"]))[-1]["lp"]
    decode.add_request(_request("lp", PROMPTS[0], sampling, TransferParams("t-lp", "import")))
    prefill.add_request(_request("lp", PROMPTS[0], sampling, TransferParams("t-lp", "export", peer)))
    got = _run([prefill, decode], _finished(["lp"]))[-1]["lp"]
    first = got[0]
    assert first.new_token_ids == want[0].new_token_ids and first.logprobs is not None
    lp, ref = first.logprobs[0], want[0].logprobs[0]
    assert lp.token_id == ref.token_id and lp.logprob == pytest.approx(ref.logprob, abs=1e-4)
    assert [t for t, _ in lp.top] == [t for t, _ in ref.top] and len(lp.top) == 3
    assert all(o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids) for o in got)
