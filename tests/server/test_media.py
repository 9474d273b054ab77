"""Images and video through the chat API: data URLs in, 400s that name the part for anything bad, remote
URLs refused unless their host is allowed; and one real server answering an image prompt as LLM does."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

from flashinfra.multimodal.inputs import MediaLimits
from flashinfra.multimodal.prompt import TokenIds
from flashinfra.server.errors import APIError
from flashinfra.server.media import MediaPart, MediaSettings, check_parts, load_parts, media_parts
from flashinfra.server.protocol import ChatCompletionRequest

SETTINGS = MediaSettings(TokenIds(4083, 4079, 4080), MediaLimits(max_bytes=200_000, max_pixels=300 * 300,
                                                                 max_frames=16, max_items=2))


def _png(h=40, w=60, seed=0, flat=False) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels * 0 + 7 if flat else pixels).save(buf, "PNG")
    return buf.getvalue()


def _mp4(frames=6, h=64, w=96) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            img = np.full((h, w, 3), 40 * i % 256, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _parts(*content):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": list(content)}]})
    return media_parts(body.messages)


def _image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def _error(parts, settings=SETTINGS) -> APIError:
    with pytest.raises(APIError) as info:
        check_parts(parts, settings)
        load_parts(parts, settings)
    assert info.value.status == 400
    return info.value


def test_good_image_and_video_load():
    parts = _parts({"type": "text", "text": "hi"}, _image(data_url(_png())),
                   {"type": "video_url", "video_url": {"url": data_url(_mp4(), "video/mp4")}})
    assert [p.param for p in parts] == ["messages[1].content[1].image_url", "messages[1].content[2].video_url"]
    image, video = load_parts(parts, SETTINGS)
    assert image.kind == "image" and image.grid == (1, 8, 10)  # upscaled to the 16-token minimum
    assert video.kind == "video" and video.grid[0] >= 1 and video.pixels.shape[0] % 2 == 0


@pytest.mark.parametrize("url,words", [
    ("data:image/png;base64,!!!notbase64", "base64"),
    (data_url(b"this is not a png at all"), "not a readable image"),
    (data_url(_png(), "text/plain"), "mime type"),
    (data_url(_png(), "video/mp4"), "mime type"),
    ("data:image/png,rawdata", "data URL"),
    (data_url(_png(400, 400, flat=True)), "pixels"),
    (data_url(b"\0" * 300_000), "limit"),
    ("file:///etc/passwd", "scheme"),
    ("http://169.254.169.254/latest/meta-data", "not allowed"),
    ("https://example.com/cat.png", "not allowed"),
], ids=["base64", "undecodable", "text-mime", "video-mime", "not-base64-url", "pixels", "bytes", "file",
        "metadata-host", "remote-host"])
def test_bad_images_are_400s_naming_the_part(url, words):
    err = _error(_parts({"type": "text", "text": "look"}, _image(url)))
    assert err.param == "messages[1].content[1].image_url"
    assert words in err.message


def test_bad_video_and_too_many_items():
    err = _error(_parts({"type": "video_url", "video_url": {"url": data_url(b"garbage", "video/mp4")}}))
    assert err.param == "messages[1].content[0].video_url" and "video" in err.message
    err = _error(_parts(*[_image(data_url(_png(seed=i))) for i in range(3)]))
    assert err.param == "messages[1].content[2].image_url" and "limit of 2" in err.message


def test_server_without_vision_refuses_images():
    err = _error(_parts(_image(data_url(_png()))), settings=None)
    assert err.param == "messages[1].content[0].image_url" and "--enable-vision" in err.message


def test_allowed_host_is_fetched_without_redirects(monkeypatch):
    import flashinfra.server.media as media

    seen = []
    monkeypatch.setattr(media, "_fetch", lambda url, limits: seen.append(url) or _png())
    settings = MediaSettings(SETTINGS.token_ids, SETTINGS.limits, ("images.example.org",))
    (canvas,) = load_parts([MediaPart("p", "image", "https://images.example.org/a.png")], settings)
    assert seen == ["https://images.example.org/a.png"] and canvas.kind == "image"
    with pytest.raises(APIError):
        load_parts([MediaPart("p", "image", "https://evil.example.org/a.png")], settings)


@pytest.fixture(scope="module")
def mm_server(tmp_path_factory):
    from tests.multimodal.mm_reference import write_mm_checkpoint
    from tests.server.conftest import start_server

    path = tmp_path_factory.mktemp("mm-serve")
    write_mm_checkpoint(path, seed=2)
    server = start_server(path, path, "--enable-vision", "--num-blocks", "128")
    yield server, path
    server.stop()


def test_chat_with_an_image_matches_offline_generation(mm_server):
    server, path = mm_server
    png = _png(70, 90, seed=7)
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": [_image(data_url(png)), {"type": "text", "text": "What?"}]}]}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 12  # the image's placeholders count as prompt tokens

    from flashinfra import LLM, SamplingParams
    from flashinfra.server.tokenizer import Tokenizer

    # the same prompt text the chat template renders, offline
    text = Tokenizer(path).render_chat([{"role": "user",
                                         "content": "<|begin_of_image|><|image|><|end_of_image|>What?"}])
    out = LLM(path, enable_vision=True, num_blocks=128).generate(
        text, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), images=[[png]])[0]
    assert usage["prompt_tokens"] == len(out.prompt_token_ids)
    assert resp.json()["choices"][0]["message"]["content"] == out.text

    bad = dict(body, messages=[{"role": "user", "content": [_image("https://example.com/x.png")]}])
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=bad, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages[0].content[0].image_url"


def test_n_choices_share_one_encoding_and_the_metrics_count_it(mm_server):
    server, _ = mm_server
    misses, encoded = (server.metric(f"flashinfra_{name}_total") or 0.0
                       for name in ("encoder_cache_misses", "encoded_items"))
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 3,
            "messages": [{"role": "user", "content": [_image(data_url(_png(64, 64, seed=9))),
                                                      {"type": "text", "text": "Again?"}]}]}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    texts = {c["message"]["content"] for c in resp.json()["choices"]}
    assert len(resp.json()["choices"]) == 3 and len(texts) == 1  # greedy: the three choices agree
    assert server.metric("flashinfra_encoder_cache_misses_total") == misses + 1
    assert server.metric("flashinfra_encoded_items_total") == encoded + 1
    assert server.metric("flashinfra_encoder_seconds_total") > 0
    assert server.metric("flashinfra_encoder_cache_bytes") > 0


def test_video_frame_limit():
    settings = MediaSettings(SETTINGS.token_ids, MediaLimits(max_frames=2))
    part = MediaPart("messages[0].content[0].video_url", "video", data_url(_mp4(frames=12), "video/mp4"))
    with pytest.raises(APIError) as info:
        load_parts([part], settings)
    assert info.value.param == part.param and "sampled frames" in info.value.message
    (canvas,) = load_parts([part], SETTINGS)  # 12 frames at 4 fps: 3 s, sampled at 2 fps
    assert canvas.pixels.shape[0] == 6 and canvas.timestamps == (0.0, 1.0, 2.0)
