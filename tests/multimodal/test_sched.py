"""Prefix-cache keys over image content (torch-free scheduler side)."""

from __future__ import annotations

from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.sched.messages import MultiModalItem, SamplingParams
from flashinfra.engine.sched.request import Request


def _req(rid, content_hash, offset=4, length=20):
    prompt = list(range(4)) + [99] * length + list(range(10, 30))
    r = Request(rid, prompt, SamplingParams(), 0.0)
    r.mm_items = [MultiModalItem("image", content_hash, offset, length, (1, 4, 20), (1, 3, 56, 280), b"", length)]
    return r


def test_block_hashes_cover_image_content():
    a, b, c = _req("a", "h1"), _req("b", "h2"), _req("c", "h1")
    ha, hb, hc = (r.block_hashes(8) for r in (a, b, c))
    assert ha == hc
    # every block from the first one overlapping the image on differs (chained), none before it
    assert ha[0] != hb[0] and all(x != y for x, y in zip(ha, hb))


def test_prefix_of_another_image_is_not_matched():
    cm = HybridCacheManager(num_blocks=32, block_size=8, num_slots=4, num_prefix_slots=4, checkpoint_interval=8)
    a = _req("a", "h1")
    cm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    cm.register_prefix(a, 16, cm.reserve_checkpoint_slot())
    assert cm.match_prefix(_req("b", "h2")) is None
    assert cm.match_prefix(_req("c", "h1")) is not None
    # a hash collision on the block key still cannot hand over another image's prefix
    b = _req("b", "h2")
    b._block_hashes = (8, a.block_hashes(8))
    assert cm.match_prefix(b) is None
