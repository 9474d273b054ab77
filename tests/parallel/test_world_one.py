"""World size 1 through the parallel path is the plain model: no hook installed, no collective called,
no parameter copied or replaced, bit-identical logits, and the plain engine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.model.api import LoadedModel, load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.collectives import ParallelComms
from flashinfra.parallel.engine import make_engine
from flashinfra.parallel.layout import make_layout
from flashinfra.parallel.load import load_shard
from flashinfra.parallel.shard import shard_loaded, shard_parameters

PROMPTS = [[5, 17, 3, 99, 200, 7, 8], [40, 41, 42]]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "broadcast", "barrier", "new_group")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("world1"), tokenizer=False)


@pytest.fixture
def no_collectives(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called at world size 1")

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, refuse)


def _hooks(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks]


def test_shard_loaded_is_the_plain_model(checkpoint, no_collectives):
    loaded = load_model(checkpoint)
    params = {n: (p, p.data_ptr()) for n, p in loaded.model.named_parameters()}
    types = {n: type(m) for n, m in loaded.model.named_modules()}
    want = loaded.logits(PROMPTS)
    layout = make_layout(loaded.config.text, 1, 1, 0)
    assert shard_loaded(loaded, layout, ParallelComms.local()) is loaded
    shard_parameters(loaded.model, layout, ParallelComms.local())
    assert _hooks(loaded.model) == []
    assert not nn.modules.module._global_forward_hooks
    assert {n: type(m) for n, m in loaded.model.named_modules()} == types
    for n, p in loaded.model.named_parameters():
        assert p is params[n][0] and p.data_ptr() == params[n][1], n  # not replaced, not copied
    for got, ref in zip(loaded.logits(PROMPTS), want):
        assert torch.equal(got, ref)


def test_load_shard_at_world_one_is_the_plain_loader(checkpoint, no_collectives):
    plain = load_model(checkpoint)
    model = load_shard(checkpoint, make_layout(plain.config.text, 1, 1, 0), ParallelComms.local())
    assert type(model) is LoadedModel and _hooks(model.model) == []
    for got, ref in zip(model.logits(PROMPTS), plain.logits(PROMPTS)):
        assert torch.equal(got, ref)


def test_engine_at_world_one_is_the_plain_engine(checkpoint, no_collectives, monkeypatch):
    monkeypatch.setenv("RANK", "0")  # a launcher's world of one changes nothing
    monkeypatch.setenv("WORLD_SIZE", "1")
    core = make_engine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", num_blocks=16,
                                    max_num_seqs=2))
    try:
        assert type(core) is EngineCore and _hooks(core.model.model) == []
    finally:
        core.close()
