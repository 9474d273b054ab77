"""The layer-by-layer batch-invariance tool on the CPU (reference path, float32): each layer of a packed batch
against each sequence alone from the same inputs stays within the rounding bound, through prefill, a chunked
prefill with a decode row, and decode (in deterministic mode: the decode row through the decode op)."""

import torch

from flashinfra.kernels.dispatch import deterministic
from flashinfra.model.api import load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.model.invariance import ULP_BOUND, layer_diffs, summary


def test_every_layer_alone_within_rounding_of_packed(tmp_path):
    lm = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=2, tokenizer=False), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(0)

    def toks(n):
        return torch.randint(1, 512, (n,), generator=gen).tolist()

    steps = [("prefill", [toks(30), toks(3), toks(17)]), ("chunked prefill", [toks(9), toks(1), toks(20)]),
             ("decode", [toks(1), toks(1), toks(1)])]
    with deterministic(True):
        rows = summary(layer_diffs(lm, steps, block_size=8))
    assert len(rows) == 3 * (len(lm.model.layers) + 1)
    assert all(r["rows_over"] == 0 and r["max_ulps"] <= ULP_BOUND for r in rows), rows
