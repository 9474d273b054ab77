import pytest
import torch

from flashinfra.disagg.layout import (
    LayoutMismatch, check_compatible, describe, pack_request_state, page_runs, unpack_request_state,
)
from flashinfra.model.cache import ModelCache


def _cache(blocks=8, slots=3, dtype=torch.float32, width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    return ModelCache(
        block_size=4, num_blocks=blocks, num_slots=slots,
        mla_latent={0: r(blocks, 4, width), 2: r(blocks, 4, width)},
        indexer_keys={0: r(blocks, 4, 4)},
        conv_state={1: r(slots, 9, 3)},
        recurrent_state={1: r(slots, 2, 3, 3, dt=torch.float32)},
    )


def test_roundtrip_into_other_blocks_and_slot():
    src, dst = _cache(seed=1), _cache(seed=2)
    check_compatible(describe(src, "fp", "prefill"), describe(dst, "fp", "decode"))
    bufs = pack_request_state(src, [5, 1, 3], slot=2)
    unpack_request_state(dst, [0, 7, 4], slot=0, buffers=[bytes(b.numpy()) for b in bufs])
    for a, b in zip(src.mla_latent.values(), dst.mla_latent.values()):
        assert torch.equal(a[[5, 1, 3]], b[[0, 7, 4]])
    assert torch.equal(src.indexer_keys[0][[5, 1, 3]], dst.indexer_keys[0][[0, 7, 4]])
    assert torch.equal(src.conv_state[1][2], dst.conv_state[1][0])
    assert torch.equal(src.recurrent_state[1][2], dst.recurrent_state[1][0])


def test_mismatch_names_both_sides():
    a = describe(_cache(), "fp", "prefill@A")
    with pytest.raises(LayoutMismatch, match=r"prefill@A and decode@B.*float32.*bfloat16"):
        check_compatible(a, describe(_cache(dtype=torch.bfloat16), "fp", "decode@B"))
    with pytest.raises(LayoutMismatch, match="model fingerprint fp vs other"):
        check_compatible(a, describe(_cache(), "other", "decode@B"))
    with pytest.raises(LayoutMismatch, match=r"float32\[4, 6\] vs float32\[4, 8\]"):
        check_compatible(a, describe(_cache(width=8), "fp", "decode@B"))


def test_wrong_buffer_size_refused():
    src = _cache()
    bufs = pack_request_state(src, [1, 2], slot=0)
    with pytest.raises(LayoutMismatch, match="bytes, expected"):
        unpack_request_state(_cache(), [1], slot=0, buffers=bufs)


def test_page_runs_pair_ids_consecutive_on_both_sides():
    assert page_runs([5, 6, 7, 1, 2, 9], [0, 1, 2, 3, 4, 5]) == [(5, 0, 3), (1, 3, 2), (9, 5, 1)]
    assert page_runs([1, 2, 3], [4, 3, 2]) == [(1, 4, 1), (2, 3, 1), (3, 2, 1)]
    assert page_runs([], []) == []
