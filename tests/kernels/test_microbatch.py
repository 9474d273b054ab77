"""Row ranges of the micro-batches (flashinfra/kernels/microbatch.py)."""

import pytest

from flashinfra.kernels.microbatch import micro_ranges, on_two_streams


@pytest.mark.parametrize("B", [1, 2, 3, 4, 5, 8, 9, 13, 33, 64, 67, 256])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_micro_ranges_cover_the_batch_in_aligned_cuts(B, n):
    ranges = micro_ranges(B, n)
    assert ranges[0][0] == 0 and ranges[-1][1] == B
    assert all(lo < hi for lo, hi in ranges), "an empty range"
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), "ranges not consecutive"
    assert all(lo % 4 == 0 for lo, _ in ranges), "a cut off the 4-row alignment"
    assert len(ranges) <= n


def test_micro_ranges_even_where_they_can_be():
    assert micro_ranges(64, 2) == [(0, 32), (32, 64)]
    assert micro_ranges(67, 2) == [(0, 32), (32, 67)]
    assert micro_ranges(256, 4) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert micro_ranges(2, 2) == [(0, 2)]  # too few rows to cut at a multiple of 4


def test_off_cuda_the_ranges_run_in_order():
    import torch

    seen = []
    on_two_streams(micro_ranges(13, 3), lambda lo, hi: seen.append((lo, hi)), torch.device("cpu"))
    assert seen == [(0, 4), (4, 8), (8, 13)]


def test_the_side_stream_is_kept_and_never_the_callers(monkeypatch):
    """The side stream is taken once per device and kept; where the kept one is the caller's own stream (the pool
    hands its streams out in turn), another is taken. Stream objects stand in for CUDA's here."""
    import torch

    from flashinfra.kernels import microbatch

    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(self)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(microbatch, "_SIDE", {})
    dev, caller = torch.device("cuda", 0), object()
    first = microbatch.side_stream(dev, caller)
    assert microbatch.side_stream(dev, caller) is first and len(made) == 1, "not kept"
    other = microbatch.side_stream(dev, first)  # the caller's stream is the kept one
    assert other is not first and len(made) == 2
    assert microbatch.side_stream(torch.device("cuda", 1), caller) is not other, "one per device"
