"""Our logits against transformers' on tiny random checkpoints: prefill, decode, packing, chunking."""

from __future__ import annotations

import pytest
import torch

import flashinfra
from flashinfra.model.forward_batch import ForwardBatch

from .hf_reference import assert_close, build_hf_model, hf_greedy_decode, hf_logits, save, text_config

F32 = 1e-4
# Every config is compared with transformers on a full prefill, a packed batch and a chunked prefill; the
# main one ("kpool4") also on every chunk size and on 16 decode steps against transformers' cache.
CONFIGS = {
    # the default tiny layout: KDA, full + shared indexer on consecutive MLA layers, dense + MoE, n_group 2
    "kpool4": text_config(),
    "kpool1_topk_bites": text_config(index_kpool=1, index_topk=6),
    "kpool16_tied": text_config(index_kpool=16, index_topk=32, tie_word_embeddings=True),
    "groups4_topk2": text_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                                 index_kpool=4, index_topk=12),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf = build_hf_model(CONFIGS[request.param], seed=len(request.param))
    path = save(hf, tmp_path_factory.mktemp(request.param))
    return hf, flashinfra.load_model(path)


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_full_prefill(pair):
    hf, ours = pair
    ids = prompt(131, 1)
    assert_close(ours.logits([ids])[0], hf_logits(hf, ids), F32)


def test_packed_batch_matches_each_alone(pair):
    hf, ours = pair
    prompts = [prompt(n, n) for n in (1, 7, 64, 131)]
    packed = ours.logits(prompts)
    for p, got in zip(prompts, packed):
        assert_close(got, ours.logits([p])[0], F32)
    assert_close(packed[1], hf_logits(hf, prompts[1]), F32)


def run_chunked(model, ids: list[int], chunk: int, block: int = 16) -> torch.Tensor:
    table = list(range((len(ids) + block - 1) // block))
    cache = model.allocate_cache(len(table), block, 1)
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        batch = ForwardBatch.build([len(piece)], [start], [0], [table], block, "cpu")
        out.append(model.compute_logits(model.forward(torch.tensor(piece), batch, cache)))
    return torch.cat(out)


def test_chunked_prefill_matches_full(pair):
    _, ours = pair
    ids = prompt(100, 7)
    assert_close(run_chunked(ours, ids, 16), ours.logits([ids])[0], F32)


@pytest.fixture(scope="module")
def main_pair(tmp_path_factory):
    hf = build_hf_model(CONFIGS["kpool4"], seed=99)
    return hf, flashinfra.load_model(save(hf, tmp_path_factory.mktemp("main")))


@pytest.mark.parametrize("chunk", [5, 64])
def test_chunked_prefill_other_chunk_sizes(main_pair, chunk):
    _, ours = main_pair
    ids = prompt(100, 8)
    assert_close(run_chunked(ours, ids, chunk), ours.logits([ids])[0], F32)


def test_prefix_logits_do_not_depend_on_later_tokens(main_pair):
    """Causality, including the indexer's choice among tied pools (see ``indexer.top_pools``)."""
    _, ours = main_pair
    ids = prompt(90, 12)
    full = ours.logits([ids])[0]
    for n in (41, 44, 64):
        assert_close(ours.logits([ids[:n]])[0], full[:n], F32)


def test_decode_against_transformers_cache(main_pair):
    hf, ours = main_pair
    ids = prompt(37, 3)
    tokens, ref_logits = hf_greedy_decode(hf, ids, steps=16)
    block = 16
    table = list(range(4))
    cache = ours.allocate_cache(len(table), block, 1)
    batch = ForwardBatch.build([len(ids)], [0], [0], [table], block, "cpu")
    got = [ours.compute_logits(ours.forward(torch.tensor(ids), batch, cache))[-1]]
    context = len(ids)
    for tok in tokens:
        batch = ForwardBatch.build([1], [context], [0], [table], block, "cpu")
        assert batch.is_decode
        got.append(ours.compute_logits(ours.forward(torch.tensor([tok]), batch, cache))[-1])
        context += 1
    for step, (g, r) in enumerate(zip(got, ref_logits)):
        assert_close(g[None], r[None], F32), step


def test_batched_decode_mixed_contexts(main_pair):
    """Sequences at different depths decode together exactly as each alone, in scattered slots/blocks."""
    _, ours = main_pair
    prompts = [prompt(n, 100 + n) for n in (3, 20, 45)]
    block, slots = 8, [2, 0, 1]
    tables = [[9, 3], [0, 5, 7], [1, 2, 4, 6, 8, 10, 11]]
    cache = ours.allocate_cache(12, block, 3)
    batch = ForwardBatch.build([len(p) for p in prompts], [0, 0, 0], slots, tables, block, "cpu")
    h = ours.forward(torch.tensor([t for p in prompts for t in p]), batch, cache)
    nxt = ours.compute_logits(h[batch.last_token_indices]).argmax(-1).tolist()
    seqs = [p + [t] for p, t in zip(prompts, nxt)]
    for _ in range(4):
        batch = ForwardBatch.build([1, 1, 1], [len(s) - 1 for s in seqs], slots, tables, block, "cpu")
        logits = ours.compute_logits(ours.forward(torch.tensor([s[-1] for s in seqs]), batch, cache))
        for s, row in zip(seqs, logits):
            assert_close(row[None], ours.logits([s])[0][-1:], F32)
        seqs = [s + [int(r.argmax())] for s, r in zip(seqs, logits)]


def test_text_model_checkpoint_uses_embedding_head(tmp_path):
    hf = build_hf_model(text_config(), seed=5, text_only=True)
    ours = flashinfra.load_model(save(hf, tmp_path / "text"))
    assert ours.config.architecture == "Glm5NextTextModel" and ours.model.lm_head is None
    ids = prompt(50, 9)
    assert_close(ours.logits([ids])[0], hf_logits(hf, ids), F32)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_choices", "sparse_choices"])
def test_bfloat16_within_tolerance(tmp_path, sparse):
    """bf16 logits no further from float32 than transformers' own bf16, and within 2e-2 of it.

    bf16 rounding flips discrete choices (expert routing, pool selection) wherever two candidates are
    within rounding of each other, and a flip moves that token's logits by O(1) in any implementation.
    "dense_choices" routes to every expert and selects every pool, so ours must be within 2e-2 of
    transformers' bf16; "sparse_choices" keeps both choices biting, where the sound comparison is the
    distance to float32."""
    text = text_config() if sparse else text_config(index_topk=128, num_experts_per_tok=8, topk_group=2)
    hf = build_hf_model(text, seed=11, gain=0.1, spread=0.1)
    path = save(hf, tmp_path / "bf16")
    ids = prompt(70, 4)
    ref32 = hf_logits(hf, ids)
    ref16 = hf_logits(hf.to(torch.bfloat16), ids)
    ours = flashinfra.load_model(path, dtype="bfloat16").logits([ids])[0]
    if not sparse:
        assert_close(ours, ref16, 2e-2)
    assert (ours - ref32).abs().max() <= 1.5 * (ref16 - ref32).abs().max() + 1e-3
