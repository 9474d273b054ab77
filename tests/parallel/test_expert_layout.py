"""Expert-parallel size other than the tensor-parallel size, over 4 CPU gloo ranks in one world: TP=2 with
EP=4 (experts over the world, attention over two TP groups of 2), TP=4 with EP=2 (two EP groups of 2) and
TP=1 with EP=4 (attention replicated, experts over the world). Logits equal one rank's, each layout issues
only its groups' collectives, and the group layout itself is checked without processes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from flashinfra.config import load_config
from flashinfra.model.api import load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.parallel.groups import destroy_distributed, init_distributed, make_comms
from flashinfra.parallel.layout import LayoutError, ParallelLayout, make_layout
from flashinfra.parallel.load import load_shard

PROMPTS = [[5, 17, 3, 99, 200, 7, 8, 9, 10, 11, 300], [40, 41, 42, 43, 44]]
LAYOUTS = [(2, 4), (4, 2), (1, 4)]  # (tp, ep) over 4 ranks
TINY = dict(num_hidden_layers=3, layer_types=["linear_attention", "indexed_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"], indexer_types=["full", "full", "full"],
            n_routed_experts=8, linear_num_heads=4, num_attention_heads=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _expected_calls(cfg, tp: int, ep: int) -> int:
    """Collectives of one forward + logits: attention, dense MLPs, embedding and logits over the TP group
    when it has more than one rank; each MoE layer over its MoE group when that has more than one."""
    moe_layers = sum(t == "sparse" for t in cfg.mlp_layer_types)
    tp_calls = cfg.num_hidden_layers + (cfg.num_hidden_layers - moe_layers) + 2
    moe_size = ep if ep > 1 else tp
    return (tp_calls if tp > 1 else 0) + (moe_layers if moe_size > 1 else 0)


def _rank(rank: int, port: int, path: str, out: dict) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, 4, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        cfg = load_config(path).text
        for tp, ep in LAYOUTS:
            layout = make_layout(cfg, tp, ep, rank)
            comms = make_comms(layout, 60)
            model = load_shard(path, layout, comms)
            before = comms.calls
            logits = model.logits(PROMPTS)
            out[(tp, ep, rank)] = ([t.clone() for t in logits], comms.calls - before)
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ep"), tokenizer=False, **TINY)


def test_expert_parallel_other_than_tensor_parallel_matches_one_rank(checkpoint):
    with mp.Manager() as manager:
        out = manager.dict()
        # forked, not spawned: the ranks start with torch already imported, which is most of their time
        mp.start_processes(_rank, args=(_free_port(), str(checkpoint), out), nprocs=4, join=True,
                           start_method="fork")
        out = dict(out)
    ref = load_model(checkpoint).logits(PROMPTS)
    scale = max(t.abs().max().item() for t in ref)
    cfg = load_config(checkpoint).text
    for tp, ep in LAYOUTS:
        for rank in range(4):
            logits, calls = out[(tp, ep, rank)]
            assert calls == _expected_calls(cfg, tp, ep), (tp, ep, rank, calls)
            for got, want in zip(logits, ref):
                assert (got - want).abs().max().item() <= 1e-5 * scale, (tp, ep, rank)


def test_group_layout():
    a = ParallelLayout(2, 4, 3)  # world 4: TP groups {0,1} {2,3}; experts over all 4
    assert (a.world, a.tp_ranks, a.moe_ranks, a.rows(8), a.experts(8)) == (4, (2, 3), (0, 1, 2, 3), slice(4, 8),
                                                                          slice(6, 8))
    b = ParallelLayout(4, 2, 3)  # world 4: one TP group; EP groups {0,1} {2,3}
    assert (b.tp_ranks, b.moe_ranks, b.experts(8), b.moe_rows(16)) == ((0, 1, 2, 3), (2, 3), slice(4, 8), slice(8, 16))
    c = ParallelLayout(4, 1, 2)  # experts sliced by width over the TP group
    assert (c.moe_ranks, c.experts(8), c.moe_rows(16)) == ((0, 1, 2, 3), slice(0, 8), slice(8, 12))
    assert ParallelLayout(1, 2, 1).groups(1) == [(0,), (1,)]


def test_sizes_that_do_not_nest_are_refused(checkpoint):
    cfg = load_config(checkpoint).text
    with pytest.raises(LayoutError, match=r"the smaller must divide the larger \(the world is max\(tp, ep\) = 4"):
        make_layout(cfg, 3, 4, 0)
