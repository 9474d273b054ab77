"""Speculative decoding across roles: a prefill-role and a decode-role engine both with ``speculative_tokens``
move the MTP layer's pages, the target's last hidden state and the first drafts with the request; greedy
output equals a single engine without drafts, the decode engine verifies drafts from its first step, and
seeded sampling equals one speculating engine's.
An engine pair where only one side speculates is refused by the layout handshake (the MTP cache differs)."""

from __future__ import annotations

import pytest

from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import SamplingParams, TransferParams
from tests.disagg.test_roles import PROMPTS, _config, _finished, _request, _run, _tokens, two_layer_mtp_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return two_layer_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


@pytest.mark.slow
def test_speculative_decode_engine_continues_a_speculative_prefill(ckpt):
    prefill = EngineCore(_config(ckpt, role="prefill", speculative_tokens=2))
    decode = EngineCore(_config(ckpt, role="decode", speculative_tokens=2))
    both = EngineCore(_config(ckpt))
    plain = EngineCore(_config(ckpt, role="prefill"))
    try:
        sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        ids = [f"s{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            both.add_request(_request(rid, prompt, sampling))
        want = _run([both], _finished(ids))[-1]
        spec = decode.runner.speculator
        first_verified = set()  # requests whose first decode step (feeding the first token) verified drafts
        accept = spec.accept

        def recording_accept(sr, *args):
            if sr.context_len == len(sr.prompt_token_ids):
                first_verified.add(sr.request_id)
            return accept(sr, *args)

        spec.accept = recording_accept
        peer = decode.ready_message().transfer_address
        for rid, prompt in zip(ids, PROMPTS):
            decode.add_request(_request(rid, prompt, sampling, TransferParams(f"t-{rid}", "import")))
            prefill.add_request(_request(rid, prompt, sampling, TransferParams(f"t-{rid}", "export", peer)))
        got = _run([prefill, decode], _finished(ids))[-1]
        assert {r: _tokens(got[r]) for r in ids} == {r: _tokens(want[r]) for r in ids}
        assert first_verified == set(ids)  # the drafts the prefill engine made
        # seeded sampling: the generator moves with the request, rejection sampling draws as one engine would
        seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
        sids = [f"q{i}" for i in range(len(PROMPTS))]
        reference = EngineCore(_config(ckpt, speculative_tokens=2))
        try:
            for rid, prompt in zip(sids, PROMPTS):
                reference.add_request(_request(rid, prompt, seeded))
            colocated = _run([reference], _finished(sids))[-1]
        finally:
            reference.close()
        for rid, prompt in zip(sids, PROMPTS):
            decode.add_request(_request(rid, prompt, seeded, TransferParams(f"t-{rid}", "import")))
            prefill.add_request(_request(rid, prompt, seeded, TransferParams(f"t-{rid}", "export", peer)))
        got = _run([prefill, decode], _finished(sids))[-1]
        assert {r: _tokens(got[r]) for r in sids} == {r: _tokens(colocated[r]) for r in sids}
        assert all(len(_tokens(colocated[r])) == 8 for r in sids)
        # a prefill engine without the MTP cache is refused by name
        plain.add_request(_request("x", PROMPTS[0], sampling, TransferParams("t-x", "export", peer)))
        out = _run([plain], _finished(["x"]), errors_ok=True)[-1]["x"][-1]
        assert out.finish_reason == "error" and "cache layout mismatch" in out.error
        assert "mla_latent[2] only on decode engine" in out.error
    finally:
        for core in (prefill, decode, both, plain):
            core.close()
