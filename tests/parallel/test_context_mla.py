"""The MLA/DSA layers under context parallelism (``parallel/context_mla.py``) over CPU gloo ranks: which latent rows
a rank needs, and, on a prompt long against the indexer's top-k, the bytes each MLA layer moves with the full
all-gather (no Layer Split) and with the selected rows (Layer Split), both giving one rank's hidden state and
next decode logits within float32 rounding."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from flashinfra.model.api import load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import split_prompt
from flashinfra.parallel.context_mla import latent_needs, selected_positions
from flashinfra.parallel.context_model import ContextParallelModel
from flashinfra.parallel.groups import destroy_distributed, init_distributed

BS, SLOT = 8, 1
PREFIX = [5, 17, 3, 99, 200, 7, 8, 9, 10, 11]
LONG = [(i * 53 + 29) % 500 + 1 for i in range(230)]  # 30x the tiny model's top-k (8 tokens)
NEXT = 42
TABLE = list(range(32))


def test_selected_positions_both_forms():
    kernel = torch.tensor([[0, 5, -1], [5, 9, -1]], dtype=torch.int32)
    assert selected_positions(kernel, 12, "cpu").nonzero().flatten().tolist() == [0, 5, 9]
    masks = [torch.tensor([[True, False, False], [False, False, True]]), torch.tensor([[False, False, False, True]])]
    assert selected_positions(masks, 6, "cpu").nonzero().flatten().tolist() == [0, 2, 3]


def test_latent_needs_owner_takes_all_others_their_selection():
    split = split_prompt(12, 2)  # rank 0: new tokens 0..5, rank 1: 6..11; 4 tokens cached before them
    chosen = torch.tensor([[1, 5, 11, -1]], dtype=torch.int32)  # sequence positions: new tokens 1 and 7
    assert latent_needs(split, 1, 4, chosen, None) is None  # no Layer Split: the full all-gather
    assert latent_needs(split, 0, 4, chosen, 0).nonzero().flatten().tolist() == list(range(6, 12))
    assert latent_needs(split, 1, 4, chosen, 0).nonzero().flatten().tolist() == [1]  # not its own token 7


class MeasuringComm(Comm):
    """Counts the bytes this rank receives from other ranks through all-gathers and all-to-alls."""

    def __init__(self, world: int):
        super().__init__(world)
        self.received = 0
        self.all_to_alls = 0

    def all_gather(self, x):
        self.received += (self.world - 1) * x.nbytes
        return super().all_gather(x)

    def all_to_all(self, x, send, recv):
        self.all_to_alls += 1
        out = super().all_to_all(x, send, recv)
        self.received += out.nbytes
        return out


def _measure(model, comm: MeasuringComm) -> dict:
    """Bytes received per MLA layer while it runs (the broadcasts of Layer Split are not counted)."""
    per_layer: dict[int, int] = {}
    for layer in model.model.layers:
        if not layer.is_kda:
            def pre(m, args):
                per_layer[m.layer] = per_layer.get(m.layer, 0) - comm.received

            def post(m, args, out):
                per_layer[m.layer] += comm.received

            layer.attn.register_forward_pre_hook(pre)
            layer.attn.register_forward_hook(post)
    return per_layer


def _scenario(model, cache, before_long=lambda: None):
    """Prefix prefill, the long prefill (its last row's hidden state), one decode step -> (hidden, decode logits);
    ``before_long`` runs just before the long prefill."""
    dev = model.device
    model.forward(torch.tensor(PREFIX), ForwardBatch.build([len(PREFIX)], [0], [SLOT], [TABLE], BS, dev), cache)
    before_long()
    long = ForwardBatch.build([len(LONG)], [len(PREFIX)], [SLOT], [TABLE], BS, dev)
    hidden = model.forward(torch.tensor(LONG), long, cache, rows=torch.tensor([len(LONG) - 1]))
    n = len(PREFIX) + len(LONG)
    h = model.forward(torch.tensor([NEXT]), ForwardBatch.build([1], [n], [SLOT], [TABLE], BS, dev), cache)
    return hidden.clone(), model.compute_logits(h)[0].clone()


def _case(rank: int, world: int, layer_split: bool, path: str):
    """-> (hidden, decode logits, bytes received per MLA layer in the long prefill, all-to-alls issued)."""
    comm = MeasuringComm(world)
    model = ContextParallelModel(load_model(path), comm, rank, min_tokens=len(LONG), zigzag=True,
                                 layer_split=layer_split)
    measured: list[dict] = []  # the decode step after the long prefill moves no gathered bytes
    hidden, logits = _scenario(model, model.allocate_cache(len(TABLE), BS, 2),
                               lambda: measured.append(_measure(model, comm)))
    return hidden, logits, measured[0], comm.all_to_alls


def _rank(rank: int, world: int, port: int, path: str, out: dict) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        out[rank] = [_case(rank, world, split, path) for split in (False, True)]
    finally:
        destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cpmla"), tokenizer=False)


def _close(got, want, what):
    scale = max(want.abs().max().item(), 1e-30)
    err = (got - want).abs().max().item()
    assert err <= 5e-5 * scale, f"{what}: max error {err:.3g} against scale {scale:.3g}"


@pytest.mark.parametrize("world", [2, 4])
def test_selected_latent_rows_move_fewer_bytes_and_match_one_rank(checkpoint, world):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(checkpoint)
        hidden, logits = _scenario(model, model.allocate_cache(len(TABLE), BS, 2))
    finally:
        torch.set_num_threads(threads)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(world, _free_port(), str(checkpoint), out), nprocs=world,
                           start_method="fork")
        out = dict(out)
    totals = {}
    for i, layer_split in enumerate((False, True)):
        for rank in range(world):
            got_hidden, got_logits, _, a2a = out[rank][i]
            where = f"world {world} layer split {layer_split} rank {rank}"
            _close(got_hidden, hidden, f"{where} hidden")
            _close(got_logits, logits, f"{where} decode logits")
            assert (a2a > 0) == layer_split, f"{where}: {a2a} all-to-alls"
        layers = out[0][i][2]
        totals[layer_split] = {layer: sum(out[r][i][2][layer] for r in range(world)) for layer in layers}
    print(f"\nworld {world}, {len(LONG)} new tokens: bytes received per MLA layer over all ranks, "
          f"full all-gather {totals[False]}, selected rows {totals[True]}")
    for layer, full in totals[False].items():
        assert totals[True][layer] < full, f"layer {layer}: selected {totals[True][layer]} >= full {full}"
