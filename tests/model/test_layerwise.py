"""``model.layerwise``'s per-row figure: which token a layer's kernel path is furthest off on."""

import torch

from flashinfra.model.layerwise import _worst_row


def test_worst_row_names_the_row_furthest_off_relatively():
    ref = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(0))
    a = ref.clone()
    a[1] += 1e-3 * ref[1]  # 0.1% off
    a[3] += 2e-2 * ref[3]  # 2% off: the worst
    a[4] = ref[4] * 1.01  # 1% off
    row, err = _worst_row(a, ref)
    assert row == 3 and abs(err - 2e-2) < 1e-6
    assert _worst_row(ref, ref)[1] == 0.0
