"""The speculative steps' CUDA-graph inputs under Triton's CPU interpreter (the kernel path a graph captures, run
eagerly): a verify step padded into a graph's static buffers gives its tokens the hidden states of the step run
alone, writes no real row's cache or ring entry that the step alone does not, and folds to the same states; the
draft chain's graph body gives the eager chain's drafts and cache entries, and so does the catch-up graph's body (the
catch-up padded to k + 2 tokens a row, then the chain) against the eager catch-up and chain."""

import copy
import dataclasses

import pytest
import torch

from flashinfra.engine.cuda_graphs import StepBuffers
from flashinfra.engine.draft_graphs import CatchupBuffers, ChainBuffers, chain_steps
from flashinfra.engine.speculative import Speculator
from flashinfra.model.api import load_model
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.replay import kda_fold
from flashinfra.model.staging import HostStaging
from tests.disagg.test_roles import two_layer_mtp_checkpoint
from tests.spec_oracle import plant_drafts

BS, K = 4, 3
PROMPTS = (9, 3, 14)
TABLES = [[0, 1, 2, 3], [4], [5, 6, 7, 8]]  # each prompt and its drafts fit; blocks 9-11 unused
SCRATCH_BLOCK, SCRATCH_SLOT = 12, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = load_model(two_layer_mtp_checkpoint(tmp_path_factory.mktemp("m")))
    cache = model.allocate_cache(SCRATCH_BLOCK + 1, BS, SCRATCH_SLOT + 1)
    spec = Speculator(model, cache, K, BS)  # the rings: one per slot, the scratch slot's too
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 500, (sum(PROMPTS),), generator=gen)
    batch = ForwardBatch.build(list(PROMPTS), [0] * 3, [0, 1, 2], TABLES, BS, "cpu")
    model.forward(ids, batch, cache)
    return model, cache, spec


def test_padded_verify_step_equals_the_step_alone(setup):
    model, cache, _ = setup
    qlens = [4, 1, 2]  # 3, 0 and 1 drafts
    batch = dataclasses.replace(ForwardBatch.build(qlens, list(PROMPTS), [0, 1, 2], TABLES, BS, "cpu"),
                                replay=(True,) * 3)
    ids = torch.randint(10, 500, (sum(qlens),), generator=torch.Generator().manual_seed(1))
    alone, padded = copy.deepcopy(cache), copy.deepcopy(cache)
    want = model.forward(ids, batch, alone)
    buf = StepBuffers(4, 16, K + 1, BS, SCRATCH_BLOCK, SCRATCH_SLOT, "cpu")
    at = buf.fill(ids, batch)
    got = model.forward(buf.input_ids, buf.batch, padded)[at]
    assert float((got - want).norm() / want.norm()) < 1e-5
    for name in ("mla_latent", "indexer_keys", "indexer_pool_keys"):
        for layer, t in getattr(alone, name).items():
            assert torch.allclose(getattr(padded, name)[layer][:SCRATCH_BLOCK], t[:SCRATCH_BLOCK], atol=1e-6), name
    for layer, ring in alone.replay.items():
        other = padded.replay[layer]
        for slot, q in enumerate(qlens):  # the row's own entries; past them the pad tokens' (never folded)
            for f in ("x", "k", "v", "g", "beta"):
                assert torch.allclose(getattr(other, f)[slot, :q], getattr(ring, f)[slot, :q], atol=1e-6), f
        for c in (alone, padded):
            kda_fold(c.replay[layer], c.conv_state[layer], c.recurrent_state[layer], [0, 1, 2], qlens)
        for states in ("conv_state", "recurrent_state"):
            a, b = getattr(alone, states)[layer][:3], getattr(padded, states)[layer][:3]
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), states


def test_chain_body_equals_the_eager_chain(setup):
    model, _, spec = setup
    gen = torch.Generator().manual_seed(2)
    for t in (*spec.mtp_cache.mla_latent.values(), *spec.mtp_cache.indexer_keys.values(),
              *spec.mtp_cache.indexer_pool_keys.values()):
        t.copy_(torch.randn(t.shape, generator=gen))
    pos = [13, 4, 15]  # the next position of each row: two chained steps, none (a full table), one
    steps = chain_steps(pos, TABLES, K, BS)
    assert steps == [2, 0, 1]
    h = torch.randn(3, model.config.text.hidden_size, generator=gen)
    start = spec.mtp_cache
    spec.mtp_cache = eager_cache = copy.deepcopy(start)
    want = spec._chain(h, pos, [0, 1, 2], TABLES, steps)
    spec.mtp_cache = graph_cache = copy.deepcopy(start)
    buf = ChainBuffers(spec, 4, 16, SCRATCH_BLOCK, SCRATCH_SLOT)
    buf.fill(h, pos, TABLES, HostStaging("cpu"))
    got, want = buf.drafts(buf.chain(), steps), buf.drafts(want, steps)
    spec.mtp_cache = start
    assert got == want and [len(d) for d in got] == [3, 1, 2]
    for name in ("mla_latent", "indexer_keys", "indexer_pool_keys"):
        for layer, t in getattr(eager_cache, name).items():
            other = getattr(graph_cache, name)[layer]
            assert torch.allclose(other[:SCRATCH_BLOCK], t[:SCRATCH_BLOCK], atol=1e-6), name


def test_catchup_body_equals_the_eager_catchup_and_chain(setup):
    model, _, spec = setup
    gen = torch.Generator().manual_seed(3)
    for t in (*spec.mtp_cache.mla_latent.values(), *spec.mtp_cache.indexer_keys.values(),
              *spec.mtp_cache.indexer_pool_keys.values()):
        t.copy_(torch.randn(t.shape, generator=gen))
    # catch-ups of 5 entries (k + 2: the previous step's last position, the fed token and 3 kept drafts), 1 and 2
    qlens, ctxs = [5, 1, 2], [8, 2, 13]
    batch = ForwardBatch.build(qlens, ctxs, [0, 1, 2], TABLES, BS, "cpu")
    ids = torch.randint(10, 500, (sum(qlens),), generator=gen)
    hidden = torch.randn(sum(qlens), model.config.text.hidden_size, generator=gen)
    pos = [c + q for c, q in zip(ctxs, qlens)]
    steps = chain_steps(pos, TABLES, K, BS)
    assert steps == [2, 1, 1]
    embed = model.model.embed_tokens
    start = spec.mtp_cache
    spec.mtp_cache = eager_cache = copy.deepcopy(start)
    out = spec.mtp(embed[ids], hidden, batch, spec.mtp_cache)
    last = out[[n - 1 for n in batch.cu_seqlens_list[1:]]]
    want = spec._chain(last, pos, [0, 1, 2], TABLES, steps)
    spec.mtp_cache = graph_cache = copy.deepcopy(start)
    buf = CatchupBuffers(spec, 4, 16, SCRATCH_BLOCK, SCRATCH_SLOT)
    buf.fill(ids, hidden, batch, pos, TABLES, HostStaging("cpu"))
    got, want = ChainBuffers.drafts(buf.body(), steps), ChainBuffers.drafts(want, steps)
    spec.mtp_cache = start
    assert float((buf.chain.hidden[:3] - last).norm() / last.norm()) < 1e-5
    assert got == want and [len(d) for d in got] == [3, 2, 2]
    for name in ("mla_latent", "indexer_keys", "indexer_pool_keys"):
        for layer, t in getattr(eager_cache, name).items():
            other = getattr(graph_cache, name)[layer]
            assert torch.allclose(other[:SCRATCH_BLOCK], t[:SCRATCH_BLOCK], atol=1e-5), name


class _EagerGraph:
    """A captured graph's stand-in: each replay runs the body again into the first run's output."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        out = self.fn()
        if self.out is not None:
            self.out.copy_(out)


class _EagerPool:
    def capture(self, fn):
        out = fn()
        return _EagerGraph(fn, out), out


def _engine_with_eager_graphs(ckpt, overlap: bool, want: dict | None = None):
    """An engine drafting k = 3 whose step, draft and fold "graphs" run their bodies eagerly (the scratch block and
    slot: the last of each, which these few short requests never take); ``overlap``: the overlapped step allowed;
    drafts recorded and, given ``want``, planted (``tests/spec_oracle.py``). -> the engine, the MTP layer's drafts,
    the overlapped launches' row counts."""
    import flashinfra
    from flashinfra.engine.cuda_graphs import DecodeGraphs
    from flashinfra.engine.draft_graphs import DraftGraphs, FoldGraphs

    llm = flashinfra.LLM(str(ckpt), num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
                         prefix_cache_slots=0, speculative_tokens=K)
    runner = llm.engine.runner
    spec, cache = runner.speculator, runner.cache
    graphs = DecodeGraphs(runner.model, cache, cache.num_blocks - 1, cache.num_slots - 1, verify_q=K + 1)
    graphs.pool = _EagerPool()
    runner.graphs = graphs
    spec.graphs, spec.fold_graphs = DraftGraphs(spec, graphs), FoldGraphs(cache, graphs)
    real_can_run, real_launch, real_step_launch = spec.overlap.can_run, spec.overlap.launch, runner.launch
    spec.overlap.can_run = lambda *a: overlap and real_can_run(*a)
    launched = []

    def overlap_launch(sched, *a):
        launched.append(len(sched))
        return real_launch(sched, *a)

    def step_launch(plan, prev=None):
        assert all(graphs.scratch_block not in sr.block_table and sr.state_slot != graphs.scratch_slot
                   for sr in plan.scheduled)
        return real_step_launch(plan, prev)

    spec.overlap.launch, runner.launch = overlap_launch, step_launch
    return llm, plant_drafts(llm, want, 500), launched


def test_overlapped_step_gives_the_plain_steps_tokens_and_drafts(tmp_path):
    """Acceptance, fold and catch-up launched on the device before the host reads anything (``spec_overlap``) give
    the greedy tokens (rows accepting 0 to k drafts, planted) and, at every position both runs draft from, the MTP
    layer's own drafts of the plain step, which reads the argmax first."""
    from flashinfra import SamplingParams

    ckpt = two_layer_mtp_checkpoint(tmp_path / "m")
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 6)]
    llm, plain_drafts, launched = _engine_with_eager_graphs(ckpt, overlap=False)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert not launched
    llm, drafts, launched = _engine_with_eager_graphs(ckpt, overlap=True,
                                                      want={tuple(p): w for p, w in zip(prompts, want)})
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    spec = llm.engine.runner.speculator
    assert launched and spec.num_accepted_at[K - 1] > 0 and spec.num_drafted > sum(spec.num_accepted_at), (
        spec.num_accepted_at, spec.num_drafted_at)
    common = [key for key in drafts if key in plain_drafts]
    assert len(common) >= 5
    for key in common:
        n = min(len(drafts[key]), len(plain_drafts[key]))
        assert drafts[key][:n] == plain_drafts[key][:n], key
