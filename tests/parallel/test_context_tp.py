"""Tensor parallelism inside context parallelism over 4 CPU gloo ranks (tp 2 x cp 2, zig-zag, with and without
Layer Split): the long prefill with its prefix checkpoints split over the context-parallel ranks, each a
tensor-parallel group's shard, gives one rank's hidden states, next decode logits, KDA states (this rank's heads,
the checkpoints' included) and MLA latent within float32 rounding (``test_context.py``'s scenario); the start-up
check takes tp x cp and refuses expert parallelism with context parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from flashinfra.config import load_config
from flashinfra.engine.config import EngineConfig
from flashinfra.parallel.engine import check_layout
from flashinfra.parallel.launch import config_world
from flashinfra.parallel.context_model import ContextParallelModel
from flashinfra.parallel.groups import destroy_distributed, init_distributed, make_context_comms
from flashinfra.parallel.layer_split import owned_layers
from flashinfra.parallel.layout import make_layout
from flashinfra.parallel.load import load_shard
from tests.parallel.test_context import (BS, LONG, NUM_SLOTS, TABLE, _close, _free_port, _long_batch, _scenario,
                                         _states, checkpoint, single)

__all__ = ["checkpoint", "single"]  # the fixtures, shared with test_context.py
TP, CP = 2, 2


def _case(rank: int, layer_split: bool, comms, cp_comm, path: str):
    text = load_config(path).text
    layout = make_layout(text, TP, 1, rank % TP)
    model = ContextParallelModel(load_shard(path, layout, comms), cp_comm, rank // TP, min_tokens=len(LONG),
                                 zigzag=True, layer_split=layer_split)
    cache = model.allocate_cache(len(TABLE), BS, NUM_SLOTS)
    batch = _long_batch(model.device)
    assert model.splits(batch)
    hidden, logits = _scenario(model, cache, batch, torch.tensor(LONG))
    owned = owned_layers(text.mla_layers, CP, rank // TP) if layer_split else text.mla_layers
    return hidden.clone(), logits.clone(), _states(model, cache), layout.rows(text.linear_num_heads), owned


def _rank(rank: int, port: int, path: str, out: dict) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, TP * CP, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        comms, cp_comm = make_context_comms(TP, CP, rank, 60)
        out[rank] = [_case(rank, layer_split, comms, cp_comm, path) for layer_split in (False, True)]
    finally:
        destroy_distributed()


@pytest.mark.slow
def test_tensor_parallel_inside_context_parallel_matches_one_rank(checkpoint, single):
    hidden, logits, states = single
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(_free_port(), str(checkpoint), out), nprocs=TP * CP, start_method="fork")
        out = dict(out)
    for rank in range(TP * CP):
        for layer_split, (got_hidden, got_logits, got, heads, owned) in zip((False, True), out[rank]):
            where = f"tp {TP} x cp {CP} rank {rank} layer split {layer_split}"
            _close(got_hidden, hidden, f"{where} hidden")
            _close(got_logits, logits, f"{where} decode logits")
            for layer, want in states["state"].items():  # [slots, heads, K, V]: this rank's heads
                _close(got["state"][layer], want[:, heads], f"{where} layer {layer} state")
            for layer in owned:
                _close(got["latent"][layer], states["latent"][layer], f"{where} layer {layer} latent")


def test_layout_check_takes_tensor_parallel_refuses_expert_parallel(checkpoint):
    both = EngineConfig(model=str(checkpoint), tensor_parallel_size=2, context_parallel_size=2)
    check_layout(both)
    assert config_world(both) == 4
    with pytest.raises(ValueError, match="context_parallel_size 2 with expert_parallel_size 2"):
        check_layout(EngineConfig(model=str(checkpoint), tensor_parallel_size=2, expert_parallel_size=2,
                                  context_parallel_size=2))
