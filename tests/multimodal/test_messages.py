"""The n choices of a prompt with images travel to the engine as one message holding each image once."""

from __future__ import annotations

import time

from flashinfra.engine.sched import messages as m


def _item(seed: int, offset: int) -> m.MultiModalItem:
    pixels = bytes([seed]) * (3 * 112 * 112)
    return m.MultiModalItem("image", f"hash{seed}", offset, 4, (1, 8, 8), (1, 3, 112, 112), pixels, 16)


def test_shared_images_travel_once_and_are_shared_after_decoding():
    a, b = _item(1, 0), _item(2, 10)
    requests = [m.EngineRequest(f"r{i}", list(range(20)), m.SamplingParams(), time.time(), [a, b]) for i in range(4)]
    requests.append(m.EngineRequest("other", [1, 2], m.SamplingParams(), time.time()))
    data = m.encode(m.EngineRequests.shared_media(requests))
    one_copy = len(a.pixels) + len(b.pixels)
    assert one_copy < len(data) < 1.5 * one_copy  # the pixels once, not once per choice
    received = m.decode_server_message(data).with_media()
    assert [r.request_id for r in received] == ["r0", "r1", "r2", "r3", "other"]
    for r in received[:4]:
        assert r.mm_items == [a, b]
        assert r.mm_items[0].pixels is received[0].mm_items[0].pixels  # one bytes object for all choices
    assert received[4].mm_items == []
