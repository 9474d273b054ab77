"""The encode role with a tiny vision checkpoint, engines in one process over the loopback: an encode engine
(the vision tower alone), a prefill-role engine that takes its images' embeddings from it instead of
encoding, and a decode-role engine without vision; greedy output for an image prompt equals a single engine's.
An encode engine that is not there fails the request with a message that names it."""

from __future__ import annotations

import pytest
import torch

from flashinfra import LLM
from flashinfra.disagg.encode import EncodeServer, embedding_layout, load_tower
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams, TransferParams
from flashinfra.multimodal.llm_inputs import multimodal_prompt
from tests.disagg.test_roles import _finished, _run, _tokens
from tests.multimodal.mm_reference import random_image, write_mm_checkpoint
from tests.server.conftest import free_port

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", num_blocks=128, block_size=16, max_num_seqs=4, prefix_cache_slots=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("mm")
    write_mm_checkpoint(path, seed=2)
    tower, config = load_tower(path, "float32", "cpu")
    encoder = EncodeServer(tower, embedding_layout(config.vision, config.text.hidden_size, torch.float32,
                                                   "encode engine"))
    both = LLM(path, enable_vision=True, **ENGINE)
    from flashinfra.engine.config import EngineConfig

    prefill = EngineCore(EngineConfig(model=str(path), role="prefill", enable_vision=True, **ENGINE))
    decode = EngineCore(EngineConfig(model=str(path), role="decode", **ENGINE))
    yield both, encoder, prefill, decode
    for x in (encoder, prefill, decode):
        x.close()


def _request(rid, prompt, items, transfer=None):
    return EngineRequest(rid, list(prompt), GREEDY, 0.0, mm_items=list(items), transfer=transfer)


def test_encode_prefill_decode_equals_a_single_engine(setup):
    both, encoder, prefill, decode = setup
    assert decode.model.vision is None  # the decode engine holds no tower
    img = random_image(80, 110, seed=0)
    prompt, items = multimodal_prompt(both, "Describe it.", [img], None)
    want = both.engine
    want.add_request(_request("ref", prompt, items))
    want = _run([want], _finished(["ref"]))[-1]["ref"]
    peer = decode.ready_message().transfer_address
    for rid in ("a", "b"):  # the second asks again for the image the first brought: a cache hit
        decode.add_request(_request(rid, prompt, items, TransferParams(f"t-{rid}", "import")))
        prefill.add_request(_request(rid, prompt, items, TransferParams(f"t-{rid}", "export", peer,
                                                                        encoder=encoder.address)))
        got = _run([prefill, decode], _finished([rid]))[-1][rid]
        assert _tokens(got) == _tokens(want) and len(_tokens(want)) == 5
    assert prefill.runner.embedder.num_encoded == 0 and encoder.num_encoded == 1
    assert prefill.disagg.num_remote_encoded == 2


def test_an_absent_encode_engine_fails_the_request(setup):
    both, _, prefill, decode = setup
    prompt, items = multimodal_prompt(both, "Describe it.", [random_image(64, 64, seed=5)], None)
    absent = f"tcp://127.0.0.1:{free_port()}"
    prefill.add_request(_request("x", prompt, items, TransferParams("t-x", "export",
                                                                    decode.ready_message().transfer_address,
                                                                    encoder=absent)))
    out = _run([prefill], _finished(["x"]), errors_ok=True, timeout_s=30)[-1]["x"][-1]
    assert out.finish_reason == "error" and f"no answer from the encode engine at {absent}" in out.error
    assert prefill.stats().num_blocks_free == prefill.stats().num_blocks_total
