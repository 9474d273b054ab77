"""The variable-length kernels' index tensors (flashinfra/kernels/varlen.py): their values, the cache, and on
a GPU that a prefill layer's varlen ops queue their copies without synchronising the stream."""

from __future__ import annotations

import pytest
import torch

from flashinfra.kernels import varlen


def test_chunk_tables_values():
    cu = [0, 130, 130, 131, 195]  # 3 chunks of 64, an empty sequence, one token, 64 tokens
    idx, offsets, nch = varlen.chunk_tables(cu, 64, "cpu")
    pairs = [(0, 0), (0, 1), (0, 2), (2, 0), (3, 0)]
    assert nch == 5 and idx.view(-1, 2).tolist() == [list(p) for p in pairs]
    assert idx.tolist() == [x for p in pairs for x in p] and idx.dtype == torch.int32
    assert offsets.tolist() == [0, 3, 3, 4] and offsets.dtype == torch.int32
    idx16, offsets16, nch16 = varlen.chunk_tables(cu, 16, "cpu")
    assert nch16 == 9 + 1 + 4 and offsets16.tolist() == [0, 9, 9, 10]
    _, offsets0, nch0 = varlen.chunk_tables([0], 64, "cpu")
    assert nch0 == 0 and offsets0.numel() == 0


def test_cached_ints_reuses_per_values():
    a = varlen.cached_ints([0, 5, 9], "cpu")
    assert a.tolist() == [0, 5, 9] and a.dtype == torch.int32
    assert varlen.cached_ints((0, 5, 9), "cpu") is a  # a later layer of the same batch
    assert varlen.cached_ints([0, 5, 10], "cpu") is not a
    assert varlen.cached_ints([True, False], "cpu").tolist() == [1, 0]


def test_cached_int_lists_splits_one_copy():
    cu, slots, init = varlen.cached_int_lists(([0, 5, 9], [3, 1], [True, False]), "cpu")
    assert (cu.tolist(), slots.tolist(), init.tolist()) == ([0, 5, 9], [3, 1], [1, 0])
    assert cu.dtype == slots.dtype == init.dtype == torch.int32
    assert cu.untyped_storage().data_ptr() == init.untyped_storage().data_ptr()  # views of one tensor
    again = varlen.cached_int_lists(([0, 5, 9], (3, 1), [1, 0]), "cpu")
    assert again[0] is cu and again[2] is init  # cached, views included
    other = varlen.cached_int_lists(([0, 5], [9, 3, 1], [1, 0]), "cpu")  # the same values, split otherwise
    assert other[0].tolist() == [0, 5] and other[1].tolist() == [9, 3, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_ops_do_not_sync():
    """The conv and the KDA prefill of one layer, lists in, under CUDA's sync debug mode set to error: a
    pageable host-to-device copy (or any other stream sync) raises."""
    from flashinfra.kernels.kda.conv import causal_conv1d_prefill_launch
    from flashinfra.kernels.kda.prefill import kda_prefill_gated_launch

    torch.manual_seed(0)
    H, K, lens = 4, 128, [200, 1, 77]
    T, cu = sum(lens), [0, 200, 201, 278]
    dev = "cuda"
    x = torch.randn(T, 3 * H * K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3 * H * K, 4, device=dev)
    conv_state = torch.zeros(4, 3 * H * K, 3, device=dev, dtype=torch.bfloat16)
    state = torch.zeros(4, H, K, K, device=dev)
    g_raw, b = torch.randn(T, H, K, device=dev, dtype=torch.bfloat16), torch.randn(T, H, device=dev)
    A_log, dt_bias = torch.zeros(H, device=dev), torch.zeros(H * K, device=dev)
    slots, init = [2, 0, 3], [False, True, False]
    for _ in range(2):  # the second call finds its tensors cached
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = causal_conv1d_prefill_launch(x, w, conv_state, cu, slots, init)
            q, k, v = y.view(T, 3, H, K).unbind(1)
            o = kda_prefill_gated_launch(q, k, v, g_raw, b, A_log, dt_bias, -5.0, state, cu, slots, init)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(o.float()).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_is_refused():
    """Inside a CUDA graph capture the index tensors are refused, a miss and a hit alike (the feedback bench
    then times the op eagerly), and the cache still serves eager calls afterwards."""
    cu = [0, 70, 71]
    eager = varlen.cached_ints(cu, "cuda")
    for values in (cu, [0, 5, 9, 11]):
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                varlen.cached_ints(values, "cuda")
    assert varlen.cached_ints(cu, "cuda") is eager and eager.tolist() == cu


@pytest.mark.parametrize("sizes", [(1, 2, 3), (3, 0, 5, 4), (4, 4), (7,)])
def test_every_tensor_starts_on_16_bytes(sizes):
    """Triton specialises pointers on their 16-byte alignment: a view's offset must not depend on the batch."""
    values = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(sizes)]
    views = varlen.cached_int_lists(values, "cpu")
    assert [v.tolist() for v in views] == values
    assert all(v.data_ptr() % 16 == 0 for v in views)
    cu = [0, *[sum(sizes[: i + 1]) * 37 for i in range(len(sizes))]]
    idx, offsets, _ = varlen.chunk_tables(cu, 64, "cpu")
    assert idx.data_ptr() % 16 == 0 and offsets.data_ptr() % 16 == 0
