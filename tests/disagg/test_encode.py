"""The encode role with a tiny vision checkpoint, engines in one process over the loopback: an encode engine
(the vision tower alone), a prefill-role engine started for it (``encoder_address``: no tower in memory) that
takes its images' embeddings from it, and a decode-role engine without vision; greedy output for an image
prompt equals a single engine's, as does a ``both`` engine's started for the encode engine. A prefill engine
without an encode engine still loads the tower. An encode engine that is not there, or whose embeddings differ
from the prefill engine's (layout handshake), fails the request with a message that names it; an image request
to an engine that cannot embed it is refused (a 400 over HTTP)."""

from __future__ import annotations

import pytest
import torch

from flashinfra import LLM
from flashinfra.disagg.encode import EncodeServer, embedding_layout, load_tower
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams, TransferParams
from flashinfra.multimodal.encoder import encoder_reserve_bytes
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

    prefill = EngineCore(EngineConfig(model=str(path), role="prefill", enable_vision=True,
                                      encoder_address=encoder.address, **ENGINE))
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
    assert prefill.disagg.encoding.num_encoded == 2


def _weight_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def test_a_prefill_engine_started_for_an_encode_engine_holds_no_tower(setup):
    both, _, prefill, _ = setup
    tower = both.engine.model.vision
    assert prefill.model.vision is None and prefill.ready_message().vision == "encoder"
    assert not any(n.startswith("visual") or "patch_embed" in n for n in prefill.model.model.state_dict())
    assert _weight_bytes(prefill.model.model) == _weight_bytes(both.engine.model.model)
    assert _weight_bytes(tower) > 0 and both.engine.ready_message().vision == "tower"
    # the GPU memory left free beside the cache: the encoder cache only, no room for tower activations
    assert encoder_reserve_bytes(prefill.model, 1000, remote=True) == 1000
    assert encoder_reserve_bytes(both.engine.model, 1000) > 1000


def test_a_prefill_engine_without_an_encode_engine_loads_the_tower(setup, tmp_path):
    from flashinfra.engine.config import EngineConfig

    both = setup[0]
    core = EngineCore(EngineConfig(model=str(both.engine.model.path), role="prefill", enable_vision=True, **ENGINE))
    try:
        assert core.model.vision is not None and core.ready_message().vision == "tower"
        assert _weight_bytes(core.model.vision) == _weight_bytes(both.engine.model.vision)
    finally:
        core.close()


def test_a_both_engine_started_for_an_encode_engine_equals_one_with_the_tower(setup):
    both, encoder, _, _ = setup
    images = [[random_image(90, 60, seed=3)], [random_image(60, 60, seed=7)]]
    want = both.generate(["What is it?", "And this?"], GREEDY, images=images)
    llm = LLM(both.engine.model.path, enable_vision=True, encoder_address=encoder.address, **ENGINE)
    try:
        assert llm.engine.model.vision is None
        before = encoder.num_encoded
        got = llm.generate(["What is it?", "And this?"], GREEDY, images=images)
        assert [g.token_ids for g in got] == [w.token_ids for w in want] and all(len(w.token_ids) == 5 for w in want)
        assert encoder.num_encoded == before + 2 and llm.engine.runner.embedder.num_encoded == 0
    finally:
        llm.engine.close()


def test_an_engine_that_cannot_embed_refuses_images(setup):
    both, _, _, decode = setup
    prompt, items = multimodal_prompt(both, "Describe it.", [random_image(64, 64, seed=4)], None)
    with pytest.raises(ValueError, match="started without vision"):
        decode.add_request(_request("no", prompt, items))


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


def test_an_encode_engine_of_another_layout_is_refused_by_name(setup):
    both, encoder, prefill, decode = setup
    other = EncodeServer(encoder.tower, embedding_layout(both.engine.model.config.vision, 8, torch.float32,
                                                         "encode engine B"))
    try:
        prompt, items = multimodal_prompt(both, "Describe it.", [random_image(70, 70, seed=6)], None)
        prefill.add_request(_request("m", prompt, items, TransferParams("t-m", "export",
                                                                        decode.ready_message().transfer_address,
                                                                        encoder=other.address)))
        out = _run([prefill], _finished(["m"]), errors_ok=True, timeout_s=30)[-1]["m"][-1]
        assert out.finish_reason == "error" and "cache layout mismatch between encode engine B and prefill" in out.error
        assert other.num_encoded == 0
    finally:
        other.close()


@pytest.mark.slow
def test_servers_encode_prefill_decode_through_the_router_equal_a_both_server(tmp_path):
    import base64
    import io

    import httpx

    from tests.disagg.test_e2e import _kill, _spawn, _text, _wait_ready

    write_mm_checkpoint(tmp_path / "mm", seed=2)
    engine = ["--model", str(tmp_path / "mm"), "--device", "cpu", "--dtype", "float32", "--num-blocks", "128",
              "--block-size", "16", "--max-num-seqs", "4", "--prefix-cache-slots", "0", "--log-level", "warning",
              "--served-model-name", "default"]
    encoder_address = f"tcp://127.0.0.1:{free_port()}"
    encode = _spawn(tmp_path, "encode", "serve", *engine, "--role", "encode", "--transfer-address", encoder_address)
    prefill = _spawn(tmp_path, "prefill", "serve", *engine, "--enable-vision", "--role", "prefill",
                     "--encoder-address", encoder_address)
    decode = _spawn(tmp_path, "decode", "serve", *engine, "--enable-vision", "--role", "decode")
    both = _spawn(tmp_path, "both", "serve", *engine, "--enable-vision")
    router = _spawn(tmp_path, "router", "router", "--prefill", prefill.url, "--decode", decode.url,
                    "--encode", encode.url, "--log-level", "warning")
    servers = [encode, prefill, decode, both, router]
    try:
        _wait_ready(servers)
        png = io.BytesIO()
        random_image(80, 110, seed=0).save(png, format="PNG")
        url = f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}"
        for stream in (False, True):
            body = {"model": "default", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": stream,
                    "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                              {"type": "text", "text": "Describe it."}]}]}
            want = _text(both.url, "/v1/chat/completions", body)
            assert want and _text(router.url, "/v1/chat/completions", body) == want
        assert encode.metric("flashinfra_encoded_items_total") == 1
        assert httpx.get(prefill.url + "/disagg/info", timeout=10).json()["vision"] == "encoder"
        r = httpx.post(decode.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 400 and "no vision tower and no encode engine" in r.json()["error"]["message"]
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        assert f'flashinfra_router_requests_total{{engine="{encode.url}",role="encode"}} 2.0' in metrics
    finally:
        for s in servers:
            _kill(s)
