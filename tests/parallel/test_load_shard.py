"""``load_shard`` (slice by slice from the checkpoint) gives exactly the weights of loading whole and
slicing, for every rank, also from a block-FP8 checkpoint whose vocabulary split cuts through a block."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashinfra.model.api import load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.collectives import ParallelComms
from flashinfra.parallel.layout import make_layout
from flashinfra.parallel.load import load_shard
from flashinfra.parallel.shard import shard_loaded
from tests.model.test_loader import quantize_block_fp8

BLOCK = 24  # does not divide the 256 vocabulary rows of a rank


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("fp8"), tokenizer=False)
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, x in tensors.items():
        if ".mlp.experts." in name or name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = quantize_block_fp8(x, BLOCK)
        else:
            out[name] = x
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)])
def test_load_shard_equals_whole_then_sliced(fp8_checkpoint, tp, ep):
    for rank in range(tp):
        whole = load_model(fp8_checkpoint)
        layout = make_layout(whole.config.text, tp, ep, rank)
        want = shard_loaded(whole, layout, ParallelComms.local()).model.state_dict()
        shard = load_shard(fp8_checkpoint, layout, ParallelComms.local())
        assert shard.peak_host_bytes > 0
        got = shard.model.state_dict()
        assert list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)
