"""Context-parallel prefill over CPU gloo (forked ranks, 2 and 4, contiguous and zig-zag) through
``ContextParallelModel``: the hidden states (all of them, or only the sampled row), every KDA layer's final
recurrent and conv state, the states the prefill saves at its prefix checkpoints (at segment boundaries, inside
segments, and closer to a segment's start than the conv window), the MLA caches and the next decode step's logits
equal one rank's within float32 rounding, for a prefill that resumes a cached prefix; with Layer Split each rank keeps
only its MLA layers' cache, and each layer's broadcast is issued while the MLA layer before it runs and waited for
before its own layer runs."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from flashinfra.model.api import load_model
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import split_prompt
from flashinfra.parallel.context_model import ContextParallelModel
from flashinfra.parallel.groups import destroy_distributed, init_distributed
from flashinfra.parallel.layer_split import owned_layers

BS, SLOT = 8, 1
PREFIX = [5, 17, 3, 99, 200, 7, 8, 9, 10, 11]  # cached before the long prefill: its state and cache resume
LONG = [(i * 37 + 11) % 500 + 1 for i in range(45)]
NEXT = 42  # the decode step after it
TABLE = list(range(8))
# prefix checkpoints inside the long prefill, (p among its tokens, slot): on 2 and 4 ranks, contiguous or zig-zag,
# some at segment boundaries, some 1 token after a segment's start (the conv window reaches into the halo)
CKPTS = [(1, 2), (6, 3), (13, 4), (17, 5), (24, 6), (30, 7), (44, 8)]
NUM_SLOTS = 2 + len(CKPTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RecordingComm(Comm):
    """Logs each asynchronous broadcast as it is issued and as it is waited for."""

    def __init__(self, world: int):
        super().__init__(world)
        self.log: list[tuple] = []

    def broadcast_async(self, x, src):
        n = sum(e[0] == "send" for e in self.log)
        self.log.append(("send", n))
        work, log = super().broadcast_async(x, src), self.log

        class Logged:
            def wait(self):
                log.append(("wait", n))
                return work.wait()

        return Logged()


def _record_layers(model, comm: RecordingComm) -> None:
    """Log which layer each broadcast is for, and when each MLA layer starts its own work (a pre-hook after the
    Layer Split and cache-gather hooks)."""
    broadcasts, issue = model.broadcasts, model.broadcasts.issue

    def logged_issue(layer, batch, cache):
        comm.log.append(("issue", layer))
        return issue(layer, batch, cache)

    broadcasts.issue = logged_issue
    for layer in model.model.layers:
        if not layer.is_kda:
            layer.attn.register_forward_pre_hook(lambda m, args: comm.log.append(("run", m.layer)))


def _check_overlap(log: list[tuple], layers: list[int]) -> None:
    """Every MLA layer runs after the waits of its own broadcasts, and after the next layer's were issued."""
    owner: dict[int, int] = {}  # broadcast number -> layer
    latest: dict[int, list[int]] = {}  # layer -> its latest issue's broadcast numbers
    waited: set[int] = set()
    current, runs = None, 0
    for event, x in log:
        if event == "issue":
            current = x
            latest[x] = []
        elif event == "send":
            owner[x] = current
            latest[current].append(x)
        elif event == "wait":
            waited.add(x)
        else:
            runs += 1
            assert latest[x] and all(n in waited for n in latest[x]), f"layer {x} ran before its broadcast arrived"
            i = layers.index(x)
            if i + 1 < len(layers):
                nxt = latest.get(layers[i + 1], [])
                assert nxt and not any(n in waited for n in nxt), f"layer {layers[i + 1]}'s broadcast not in flight"
    assert runs >= 3 * len(layers)  # the prefix, the long prefill, the decode step
    assert waited == set(owner)


def _scenario(model, cache, batch_for_long, long_ids, rows=None):
    """Prefix prefill, the long prefill (``batch_for_long``), one decode step -> (hidden of the long part's
    tokens, or of its ``rows``, decode logits)."""
    dev = model.device
    model.forward(torch.tensor(PREFIX), ForwardBatch.build([len(PREFIX)], [0], [SLOT], [TABLE], BS, dev), cache)
    hidden = model.forward(long_ids, batch_for_long, cache, rows=rows)
    n = len(PREFIX) + len(LONG)
    h = model.forward(torch.tensor([NEXT]), ForwardBatch.build([1], [n], [SLOT], [TABLE], BS, dev), cache)
    return hidden, model.compute_logits(h)[0]


def _states(model, cache) -> dict:
    text = model.config.text
    n = len(PREFIX) + len(LONG) + 1
    slots = [SLOT] + [slot for _, slot in CKPTS]
    return {"state": {i: cache.recurrent_state[i][slots].clone() for i in text.kda_layers},
            "conv": {i: cache.conv_state[i][slots].clone() for i in text.kda_layers},
            "latent": {i: cache.mla_latent[i].flatten(0, 1)[:n].clone() for i in text.mla_layers}}


def _long_batch(device) -> ForwardBatch:
    batch = ForwardBatch.build([len(LONG)], [len(PREFIX)], [SLOT], [TABLE], BS, device)
    return dataclasses.replace(batch, checkpoints=tuple((0, p, slot) for p, slot in CKPTS))


def _one_rank(path):
    model = load_model(path)
    cache = model.allocate_cache(len(TABLE), BS, NUM_SLOTS)
    batch = _long_batch(model.device)
    hidden, logits = _scenario(model, cache, batch, torch.tensor(LONG))
    return hidden, logits, _states(model, cache)


def _case(rank: int, world: int, zigzag: bool, split_layers: bool, rows, path: str):
    """The scenario through ``ContextParallelModel``: the long prefill split, the prefix and decode replicated."""
    comm = RecordingComm(world)
    model = ContextParallelModel(load_model(path), comm, rank, min_tokens=len(LONG), zigzag=zigzag,
                                 layer_split=split_layers)
    text = model.config.text
    if split_layers:
        _record_layers(model, comm)
    cache = model.allocate_cache(len(TABLE), BS, NUM_SLOTS)
    batch = _long_batch(model.device)
    assert model.splits(batch)
    hidden, logits = _scenario(model, cache, batch, torch.tensor(LONG), None if rows is None else torch.tensor(rows))
    if split_layers:
        _check_overlap(comm.log, list(text.mla_layers))
    owned = owned_layers(text.mla_layers, world, rank) if split_layers else text.mla_layers
    return hidden.clone(), logits.clone(), _states(model, cache), owned


def _rank(rank: int, world: int, cases: list, port: int, path: str, out: dict) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=60)
    try:
        out[rank] = [_case(rank, world, *case, path) for case in cases]
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cp"), tokenizer=False)


@pytest.fixture(scope="module")
def single(checkpoint):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are far too small to gain from threads on a shared host
    try:
        return _one_rank(checkpoint)
    finally:
        torch.set_num_threads(threads)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # float32 rounding: one rank's own prefill of the long part in two chunks differs from one pass by about
    # 1.5e-5 of the hidden states' scale (different summation orders in every layer after the first)
    scale = max(want.abs().max().item(), 1e-30)
    err = (got - want).abs().max().item()
    assert err <= 5e-5 * scale, f"{what}: max error {err:.3g} against scale {scale:.3g}"


# (zig-zag, Layer Split, the long prefill's rows: all where None) cases per world size, one process group each
LAST = [len(LONG) - 1]
CASES = {2: [(False, False, None), (True, True, LAST)], 4: [(False, True, None), (True, False, LAST)]}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_prefill_matches_one_rank(checkpoint, single, world):
    hidden, logits, states = single
    with mp.Manager() as manager:
        out = manager.dict()
        # fork: the ranks start without importing torch again (CPU only, no CUDA state to inherit)
        mp.start_processes(_rank, args=(world, CASES[world], _free_port(), str(checkpoint), out), nprocs=world,
                           start_method="fork")
        out = dict(out)
    for rank in range(world):
        for case, (got_hidden, got_logits, got_states, owned) in zip(CASES[world], out[rank]):
            where = f"world {world} (zig-zag, layer split, rows) {case} rank {rank}"
            rows = case[2]
            _close(got_hidden, hidden if rows is None else hidden[rows], f"{where} hidden")
            _close(got_logits, logits, f"{where} decode logits")
            for kind in ("state", "conv"):
                for layer, want in states[kind].items():
                    _close(got_states[kind][layer], want, f"{where} layer {layer} {kind}")
            for layer in owned:  # with Layer Split, the layers this rank keeps
                _close(got_states["latent"][layer], states["latent"][layer], f"{where} layer {layer} latent")


def test_split_prompt_segments_and_owners():
    contiguous = split_prompt(10, 3)
    assert contiguous.bounds == (0, 4, 7, 10) and contiguous.owners == (0, 1, 2)
    zigzag = split_prompt(17, 2, zigzag=True, min_segment=3)
    assert zigzag.bounds == (0, 5, 9, 13, 17) and zigzag.owners == (0, 1, 1, 0)
    assert zigzag.token_index(0).tolist() == [0, 1, 2, 3, 4, 13, 14, 15, 16]
    assert zigzag.lens(1) == [4, 4]
    with pytest.raises(ValueError, match="shorter than 3 tokens"):
        split_prompt(11, 2, zigzag=True, min_segment=3)
