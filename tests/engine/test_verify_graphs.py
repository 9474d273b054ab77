"""CUDA graphs of speculative decoding: which steps replay which graph (``step_key``), how a verify step's rows are
padded into a graph's static buffers (``StepBuffers``), the draft chain's per-step inputs (``chain_steps``,
``kernels/graph_inputs.fill_chain``), which graphs the warm-up captures; on a GPU, ``LLM(speculative_tokens=k)``
gives the same tokens with the graphs as without, the verify and draft graphs replayed."""

import collections
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from flashinfra.engine.cuda_graphs import StepBuffers, graph_keys, step_key
from flashinfra.engine.draft_graphs import chain_steps
from flashinfra.kernels.graph_inputs import fill_chain_ref
from flashinfra.engine.warmup import capture_graphs
from flashinfra.model.forward_batch import ForwardBatch
from tests.spec_oracle import plant_drafts

BS = 4  # block size of the host tests
SCRATCH_BLOCK, SCRATCH_SLOT = 9, 5
E = SCRATCH_BLOCK * BS + 1  # the scratch cache slot


def _batch(qlens, ctxs, slots, tables, replay=True, **kw):
    batch = ForwardBatch.build(qlens, ctxs, slots, tables, BS, "cpu")
    return dataclasses.replace(batch, replay=(True,) * len(qlens) if replay else (), **kw)


def _verify_batch():
    """Rows of 4, 1 and 2 tokens (3, 0 and 1 drafts) verifying from contexts 5, 9 and 2."""
    return _batch([4, 1, 2], [5, 9, 2], [0, 3, 1], [[0, 1, 2], [3, 4, 5], [6]])


def test_step_key_picks_decode_verify_or_eager():
    buckets = (1, 2, 4, 8)
    decode = _batch([1, 1, 1], [5, 9, 2], [0, 3, 1], [[0, 1], [3, 4, 5], [6]], replay=False)
    assert step_key(decode, buckets) == (4, 16, 1)
    assert step_key(decode, buckets, verify_q=4) == (4, 16, 1)
    verify = _verify_batch()
    assert step_key(verify, buckets, verify_q=4) == (4, 16, 4)  # every row padded to k + 1
    assert step_key(verify, buckets, verify_q=5) == (4, 16, 5)
    assert step_key(verify, buckets) is None  # no verify graphs
    assert step_key(verify, buckets, verify_q=3) is None  # a row longer than the graphs' rows
    mixed = dataclasses.replace(verify, replay=(True, True, False))  # a prefill row beside the verify rows
    assert step_key(mixed, buckets, verify_q=4) is None
    prefill = _batch([4, 1], [0, 9], [0, 3], [[0, 1], [3, 4, 5]], replay=False)
    assert step_key(prefill, buckets, verify_q=4) is None
    assert step_key(dataclasses.replace(verify, checkpoints=((0, 2, 7),)), buckets, verify_q=4) is None
    assert step_key(verify, (1, 2), verify_q=4) is None  # more rows than the largest bucket
    wide = _batch([2, 1], [70, 3], [0, 1], [list(range(20)), [30]])
    assert step_key(wide, buckets, verify_q=4) == (2, 64, 4)


def test_verify_rows_are_padded_to_q_in_the_scratch_slot():
    batch = _verify_batch()
    ids = torch.arange(11, 18)
    buf = StepBuffers(4, 16, 4, BS, SCRATCH_BLOCK, SCRATCH_SLOT, "cpu")
    s = buf.batch
    assert s.replay == (True,) * 4 and s.query_lens == (4,) * 4
    assert s.cu_seqlens.tolist() == [0, 4, 8, 12, 16] and s.token_seq.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    at = buf.fill(ids, batch)
    assert buf.input_ids.view(4, 4).tolist() == [[11, 12, 13, 14], [15, 0, 0, 0], [16, 17, 0, 0], [0, 0, 0, 0]]
    slot = batch.slot_mapping.tolist()
    assert s.slot_mapping.view(4, 4).tolist() == [slot[:4], [slot[4], E, E, E], [*slot[5:], E, E], [E] * 4]
    # a pad token sits at its row's last position (what it reads lies within the row's table); a padding row at 1
    assert s.positions.view(4, 4).tolist() == [[5, 6, 7, 8], [9, 9, 9, 9], [2, 3, 3, 3], [1, 1, 1, 1]]
    assert s.state_slots_t.tolist() == [0, 3, 1, SCRATCH_SLOT]
    assert s.seq_lens_t.tolist() == [9, 10, 4, 2]
    tables = s.block_tables_t.tolist()
    assert tables[:3] == [[0, 1, 2] + [0] * 13, [3, 4, 5] + [0] * 13, [6] + [0] * 15]
    assert tables[3] == [SCRATCH_BLOCK] * 16
    hidden = torch.arange(16.0)[:, None] * torch.ones(1, 3)  # the graph's [bs * q, D] output
    assert hidden[at][:, 0].tolist() == [0, 1, 2, 3, 4, 8, 9]  # the step's own packing back

    # a smaller step next: the rows it leaves are padding rows again
    one = _batch([2], [6], [2], [[7, 8]])
    at = buf.fill(torch.tensor([21, 22]), one)
    assert buf.input_ids.view(4, 4).tolist() == [[21, 22, 0, 0]] + [[0] * 4] * 3
    assert s.slot_mapping.view(4, 4).tolist() == [[8 * BS + 2, 8 * BS + 3, E, E]] + [[E] * 4] * 3
    assert s.positions.view(4, 4).tolist() == [[6, 7, 7, 7]] + [[1] * 4] * 3
    assert s.state_slots_t.tolist() == [2] + [SCRATCH_SLOT] * 3 and s.seq_lens_t.tolist() == [8, 2, 2, 2]
    assert s.block_tables_t.tolist() == [[7, 8] + [0] * 14] + [[SCRATCH_BLOCK] * 16] * 3
    assert hidden[at][:, 0].tolist() == [0, 1]


def test_decode_rows_fill_the_first_rows():
    batch = _batch([1, 1, 1], [5, 9, 2], [0, 3, 1], [[0, 1], [3, 4, 5], [6]], replay=False)
    buf = StepBuffers(4, 16, 1, BS, SCRATCH_BLOCK, SCRATCH_SLOT, "cpu")
    assert buf.batch.replay == ()
    at = buf.fill(torch.tensor([7, 8, 9]), batch)
    assert at == slice(0, 3)
    s = buf.batch
    assert buf.input_ids.tolist() == [7, 8, 9, 0]
    assert s.slot_mapping.tolist() == batch.slot_mapping.tolist() + [E]
    assert s.positions.tolist() == [5, 9, 2, 1] and s.state_slots_t.tolist() == [0, 3, 1, SCRATCH_SLOT]


def test_chain_steps_stop_where_the_table_ends():
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]  # 12 positions each but the last (4)
    assert chain_steps([5, 11, 12, 2], tables, 3, BS) == [2, 1, 0, 2]
    assert chain_steps([5, 11, 12, 2], tables, 1, BS) == [0, 0, 0, 0]  # one draft: no chained step
    assert chain_steps([5, 10], tables[:2], 4, BS) == [3, 2]


def test_chain_fill_writes_own_slots_then_the_scratch():
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    pos = [5, 11, 12]
    steps = chain_steps(pos, tables, 3, BS)
    i32 = torch.int32
    caps = torch.tensor([len(t) * BS for t in tables], dtype=i32)
    dst = (torch.full((4, 5), -7, dtype=i32), torch.full((2, 4), -7), torch.full((2, 4), -7, dtype=i32),
           torch.full((2, 4), -7, dtype=i32))
    fill_chain_ref((torch.tensor(pos), caps, torch.tensor(tables, dtype=i32)), dst, BS, (E, 99))
    table, slots, positions, lengths = (t.tolist() for t in dst)
    assert steps == [2, 1, 0]  # what chain_steps tells the host of the same rows

    def at(table, p):
        return table[p // BS] * BS + p % BS

    assert sum(slots, []) == [at(tables[0], 5), at(tables[1], 11), E, E,  # the full row's steps write the scratch
                              at(tables[0], 6), E, E, E]
    assert sum(positions, []) == [5, 11, 11, 1,  # at the last position its table holds; a padding row at 1
                                  6, 11, 11, 1]
    assert lengths == [[p + 1 for p in row] for row in positions]
    assert table == [t + [0, 0] for t in tables] + [[99] * 5]  # the tables, then the padding row's scratch block


def test_warm_up_captures_decode_verify_draft_and_fold_keys():
    got = {}

    def recorder(name):
        return lambda keys: got.setdefault(name, list(keys)) and len(keys)

    for k, draft in ((0, False), (1, False), (3, True)):
        got.clear()
        graphs = SimpleNamespace(batch_buckets=(1, 2, 4, 8), step_qs=(1, k + 1) if k else (1,),
                                 capture=recorder("steps"))
        spec = SimpleNamespace(graphs=SimpleNamespace(capture=recorder("drafts")) if draft else None,
                               fold_graphs=SimpleNamespace(capture=recorder("folds")),
                               overlap=SimpleNamespace(capture=lambda g: got.setdefault("tails", g) and 5),
                               ) if k else None
        runner = SimpleNamespace(graphs=graphs, speculator=spec, block_size=16)
        pairs = graph_keys(6, 512 // 16, 100, (1, 2, 4, 8))
        n = capture_graphs(runner, max_num_seqs=6, max_model_len=512, num_blocks=100)
        want = [(b, w, 1) for b, w in pairs] + ([(b, w, k + 1) for b, w in pairs] if k else [])
        assert got["steps"] == want
        assert got.get("drafts") == (pairs if draft else None)
        assert got.get("folds") == (sorted({b for b, _ in pairs}) if k else None)  # one fold graph per batch bucket
        assert got.get("tails") is (graphs if draft else None)  # the tails of the verify graphs just captured
        assert n == len(want) + (len(pairs) + 5 if draft else 0) + (len(got["folds"]) if k else 0)
    assert capture_graphs(SimpleNamespace(graphs=None), 6, 512, 100) == 0


def test_no_graphs_on_the_cpu(tmp_path):
    from flashinfra.engine.runner import ModelRunner
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "m", seed=0, tokenizer=False, num_nextn_predict_layers=1)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size=16, num_slots=2, speculative_tokens=3)
    assert runner.graphs is None and runner.speculator.graphs is None


# --- on a GPU -------------------------------------------------------------------------------------------------

LLM_ARGS = dict(device="cuda", num_blocks=256, block_size=16, max_num_seqs=8, max_model_len=512,
                max_num_batched_tokens=64)


def _prompts(model: str, tokenizer) -> list[list[int]]:
    """Six prompts of different lengths: random tokens for the random model, held-out text for the trained one."""
    from pathlib import Path

    lens = (5, 37, 1, 20, 64, 9)
    if model == "tiny":
        gen = torch.Generator().manual_seed(11)
        return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lens]
    text = (Path(__file__).parents[1] / "eval" / "data" / "heldout-slice.txt").read_text()
    ids = tokenizer.encode(text).ids
    return [ids[40 * i : 40 * i + n] for i, n in enumerate(lens)]


def _run(path, dtype, k, graphs, prompts, params, want, monkeypatch):
    """One engine with ``k`` drafts per step, with or without its CUDA graphs, the MTP layer's drafts replaced by
    ``want``'s continuation with every fifth token wrong (so rows accept 0 to k drafts, and rows near their
    ``max_tokens`` carry fewer); -> its tokens, the MTP layer's own drafts by (prompt, tokens emitted), the engine,
    per verify step replayed from a graph whether its rows differed in length (so some were padded), and the number
    of overlapped steps (``engine/spec_overlap.py``)."""
    import flashinfra

    llm = flashinfra.LLM(str(path), dtype=dtype, speculative_tokens=k, startup_warmup=graphs, **LLM_ARGS)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.speculator.graphs is not None
    padded, overlapped = [], []
    if graphs:
        replay, launch = runner.graphs.replay, runner.speculator.overlap.launch

        def recorded(input_ids, batch):
            if batch.replay:
                padded.append(len(set(batch.query_lens)) > 1)
            return replay(input_ids, batch)

        def counted(*a):
            overlapped.append(1)
            return launch(*a)

        monkeypatch.setattr(runner.graphs, "replay", recorded)
        monkeypatch.setattr(runner.speculator.overlap, "launch", counted)
    else:
        runner.graphs = runner.speculator.graphs = runner.speculator.fold_graphs = None
    mtp_drafts = plant_drafts(llm, dict(want), 500)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    return outs, mtp_drafts, llm, padded, len(overlapped)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("model,dtype", [("tiny", "float32"), ("default", "float32"), ("default", "bfloat16")])
def test_speculative_graphs_give_the_eager_tokens(tmp_path, monkeypatch, model, dtype, k):
    """``LLM(speculative_tokens=k)`` with CUDA graphs gives the tokens it gives without, over a batch whose rows
    accept different numbers of drafts and carry different numbers near their ends (verify rows padded to k + 1);
    the verify graphs, the fold graphs, the draft catch-up graphs (and the draft-chain graphs, k > 1) are replayed, and
    verify steps run overlapped (``engine/spec_overlap.py``). bfloat16 runs the trained default model,
    whose greedy choices have margins that the rounding differences of a padded batch (its GEMMs and attention
    splits chosen by the token count) cannot flip, where a random model's often do not; float32 runs both. The MTP
    layer's own drafts (they change the speed, not the tokens) agree exactly in float32, and in bfloat16 but for a
    few near-ties."""
    import flashinfra
    from flashinfra import SamplingParams
    from flashinfra.model.factory import default_model_dir, write_tiny_checkpoint

    path = (write_tiny_checkpoint(tmp_path / "tiny", seed=0, num_nextn_predict_layers=1) if model == "tiny"
            else default_model_dir())
    base = flashinfra.LLM(str(path), dtype=dtype, startup_warmup=False, **LLM_ARGS)
    prompts = _prompts(model, base.tokenizer)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 9, 17, 6, 12, 21)]
    want = [(tuple(p), o.token_ids) for p, o in zip(prompts, base.generate(prompts, params))]
    del base

    eager, eager_drafts, _, _, _ = _run(path, dtype, k, False, prompts, params, want, monkeypatch)
    replays = collections.Counter()
    replay = torch.cuda.CUDAGraph.replay

    def counted(graph):
        replays[id(graph)] += 1
        return replay(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted)
    got, got_drafts, llm, padded, overlapped = _run(path, dtype, k, True, prompts, params, want, monkeypatch)
    assert got == eager
    runner = llm.engine.runner
    spec = runner.speculator
    verify = sum(replays[id(g)] for (_, _, q), (g, _, _) in runner.graphs.graphs.items() if q == k + 1)
    assert verify == len(padded) > 0, "the verify steps replayed a graph"
    assert any(padded), "some verify step padded its shorter rows"
    assert overlapped > 0, "verify steps ran overlapped"
    tails = sum(replays[id(body)] for _, _, body, _ in spec.overlap.tails.values())
    assert tails == overlapped, "each overlapped step replayed its verify graph's tail"
    assert tails + sum(replays[id(g)] for g, _, _ in spec.graphs.catchups.values()) > 0, "the catch-up replayed"
    assert tails + sum(replays[id(g)] for g, _, _ in spec.fold_graphs.graphs.values()) > 0, "the fold replayed"
    if k > 1:
        assert sum(replays[id(g)] for g, _, _ in spec.graphs.graphs.values()) > 0, "the draft chain replayed a graph"
    assert spec.num_accepted_at[k - 1] > 0 and spec.num_drafted > sum(spec.num_accepted_at), "acceptance varies"
    # the MTP layer's own drafts wherever both runs drafted from the same emitted tokens
    pairs = [(a, b) for key, dg in got_drafts.items() if key in eager_drafts
             for a, b in zip(dg, eager_drafts[key])]
    same = sum(a == b for a, b in pairs)
    assert pairs and (same == len(pairs) if dtype == "float32" else same >= 0.9 * len(pairs)), (same, len(pairs))
