"""CUDA-graph decode: replay equals the eager step over many steps with changing batches (sizes, members,
order, block-table widths), and the padding rows never touch a real sequence's cache."""

import random

import pytest
import torch

from flashinfra.engine.cuda_graphs import BATCH_BUCKETS, bucket


def test_bucket_rounds_up_and_refuses_oversize():
    assert [bucket(n, BATCH_BUCKETS) for n in (1, 3, 17, 128, 129)] == [1, 4, 24, 128, 160]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(BATCH_BUCKETS[-1] + 1, BATCH_BUCKETS)


def test_runner_graphs_only_on_cuda(tmp_path):
    """On the CPU the runner keeps no graphs and allocates exactly the blocks and slots asked for; on CUDA it
    adds one scratch block and slot for the padding rows."""
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.engine.runner import ModelRunner

    path = write_tiny_checkpoint(tmp_path / "tiny", seed=4, tokenizer=False)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size=16, num_slots=2, num_prefix_slots=1)
    assert runner.graphs is None and (runner.cache.num_blocks, runner.cache.num_slots) == (8, 3)
    if torch.cuda.is_available():
        runner = ModelRunner(load_model(path, device="cuda"), num_blocks=8, block_size=16, num_slots=2)
        assert runner.graphs is not None and (runner.cache.num_blocks, runner.cache.num_slots) == (9, 3)
        assert (runner.graphs.scratch_block, runner.graphs.scratch_slot) == (8, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_over_changing_batches(tmp_path):
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.model.forward_batch import ForwardBatch
    from flashinfra.engine.cuda_graphs import DecodeGraphs

    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=3), dtype="float32", device="cuda")
    bs, steps, rng = 16, 24, random.Random(0)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (5, 37, 1, 20, 64, 9, 100)]
    need = [-(-(len(p) + steps) // bs) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(prompts))]
    nblocks, nseq = sum(need), len(prompts)
    caches = [model.allocate_cache(nblocks + 1, bs, nseq + 1) for _ in range(2)]
    batch = ForwardBatch.build([len(p) for p in prompts], [0] * nseq, list(range(nseq)), tables, bs, "cuda")
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    for cache in caches:
        hidden = model.forward(ids, batch, cache)
    last = model.compute_logits(hidden[torch.tensor(batch.last_token_indices, device="cuda")]).argmax(-1).tolist()
    lens = [len(p) for p in prompts]
    graphs = DecodeGraphs(model, caches[1], scratch_block=nblocks, scratch_slot=nseq)
    for step in range(steps):
        active = rng.sample(range(nseq), rng.randint(1, nseq))
        batch = ForwardBatch.build([1] * len(active), [lens[b] for b in active], active, [tables[b] for b in active],
                                   bs, "cuda")
        ids = torch.tensor([last[b] for b in active], device="cuda")
        eager = model.forward(ids, batch, caches[0])
        replay = graphs.run(ids, batch)
        err = float((replay - eager).norm() / eager.norm())
        assert err < 1e-5, f"step {step}: graph vs eager {err}"
        tok = model.compute_logits(eager).argmax(-1).tolist()
        assert model.compute_logits(replay).argmax(-1).tolist() == tok
        for b, t in zip(active, tok):
            last[b], lens[b] = t, lens[b] + 1
    assert len(graphs.graphs) >= 3, "several buckets were captured"
    for layer, t in caches[0].mla_latent.items():  # the real blocks hold the same cache in both runs
        assert torch.allclose(t[:nblocks], caches[1].mla_latent[layer][:nblocks], rtol=1e-5, atol=1e-6)
    for layer, t in caches[0].recurrent_state.items():
        assert torch.allclose(t[:nseq], caches[1].recurrent_state[layer][:nseq], rtol=1e-4, atol=1e-5)
