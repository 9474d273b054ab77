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
