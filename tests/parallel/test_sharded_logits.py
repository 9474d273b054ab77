"""Sharded logits over CPU gloo (spawned ranks) equal one rank's, and each rank holds ~1/N of the
sharded weights."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from flashinfra.model.api import load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.groups import destroy_distributed, init_distributed, make_comms
from flashinfra.parallel.layout import LayoutError, ParallelLayout, make_layout
from flashinfra.parallel.load import load_shard
from flashinfra.parallel.shard import shard_loaded, weight_bytes

PROMPTS = [[5, 17, 3, 99, 200, 7, 8, 9, 10, 11, 300, 1, 2], [40, 41, 42, 43, 44, 45, 46]]
TINY = dict(n_routed_experts=8, linear_num_heads=4, num_attention_heads=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, ep: int, port: int, path: str, out: dict) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        whole = load_model(path)
        layout = make_layout(whole.config.text, world, ep, rank)
        comm = make_comms(layout)
        sliced = shard_loaded(whole, layout, comm)  # loaded whole, then sliced
        model = load_shard(path, layout, comm)  # read slice by slice
        for a, b in zip(sliced.model.state_dict().values(), model.model.state_dict().values()):
            assert torch.equal(a, b)
        before = comm.calls
        logits = model.logits(PROMPTS)
        # per step: 2 all-reduces per layer (attention, MLP/MoE), 1 for the embedding, 1 all-gather of logits
        assert comm.calls - before == 2 * whole.config.text.num_hidden_layers + 2
        out[rank] = ([t.clone() for t in logits], weight_bytes(model.model))
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp"), tokenizer=False, **TINY)


@pytest.fixture(scope="module")
def single(checkpoint):
    loaded = load_model(checkpoint)
    return loaded.logits(PROMPTS), weight_bytes(loaded.model)


def _run(checkpoint, world: int, ep: int):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(world, ep, _free_port(), str(checkpoint), out), nprocs=world, join=True)
        return dict(out)


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 1), (4, 4)])
def test_sharded_logits_match_one_rank(checkpoint, single, world, ep):
    ref, full_bytes = single
    out = _run(checkpoint, world, ep)
    scale = max(t.abs().max().item() for t in ref)
    for rank in range(world):
        for got, want in zip(out[rank][0], ref):
            assert (got - want).abs().max().item() <= 1e-5 * scale, (world, ep, rank)
    # every rank holds the same bytes; the replicated part (norms, mHC, routers, indexers, MLA latent
    # projections) plus 1/N of the rest
    sizes = {b for _, b in out.values()}
    assert len(sizes) == 1
    per_rank = sizes.pop()
    assert per_rank < full_bytes / world * 1.6, (per_rank, full_bytes)


def test_bad_world_size_refused_with_numbers(checkpoint):
    cfg = load_model(checkpoint).config.text
    with pytest.raises(LayoutError, match=r"linear_num_heads\) = 4 is not divisible by 3"):
        make_layout(cfg, 3, 1, 0)
    with pytest.raises(LayoutError, match="the smaller must divide the larger"):
        make_layout(cfg, 2, 3, 0)
    with pytest.raises(LayoutError, match=r"n_routed_experts\) = 8 is not divisible by 16"):
        ParallelLayout(16, 16, 0).check(cfg)
