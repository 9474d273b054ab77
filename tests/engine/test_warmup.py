"""Start-up warm-up: which decode graphs and prefill shapes a configuration needs, and a CPU no-op."""

import itertools
import random

import pytest

from flashinfra.engine.cuda_graphs import BATCH_BUCKETS, FIRST_WIDTH, bucket, graph_keys, width_bucket
from flashinfra.engine.warmup import _mixed_verify_steps, _passes, _prefill_batch, prefill_shapes, warm_up


def test_width_bucket_rounds_up_in_coarse_steps():
    assert [width_bucket(w) for w in (1, 16, 17, 64, 65, 1000, 65536)] == [16, 16, 64, 64, 256, 1024, 65536]


@pytest.mark.parametrize("max_num_seqs,max_len,block_size,num_blocks",
                         [(64, 4096, 16, 14632), (1, 1 << 20, 16, 70000), (256, 8192, 16, 600), (7, 100, 16, 40),
                          (1000, 32768, 64, 5000)])
def test_graph_keys_cover_every_reachable_decode_batch(max_num_seqs, max_len, block_size, num_blocks):
    """Every decode batch the cache can hold (sizes up to max_num_seqs within the largest bucket, tables up to
    max_len wide) maps to a captured key, and the number of keys stays small."""
    max_blocks = -(-max_len // block_size)
    keys = graph_keys(max_num_seqs, max_blocks, num_blocks)
    assert len(keys) == len(set(keys)) and len(keys) <= 120
    rng = random.Random(max_num_seqs)
    top = min(max_num_seqs, BATCH_BUCKETS[-1])
    for _ in range(3000):
        batch = rng.randint(1, top)
        widest = rng.randint(1, min(max_blocks, num_blocks - (batch - 1)))
        assert (bucket(batch, BATCH_BUCKETS), width_bucket(widest)) in keys, (batch, widest)


def test_graph_keys_leave_out_what_the_cache_cannot_hold():
    # 40 blocks: a 64-wide table (more than 16 blocks) fits for small batches only.
    keys = graph_keys(64, 1000, 40)
    assert (1, 64) in keys and (16, 64) in keys and (32, 64) not in keys
    assert all(w <= 64 for _, w in keys)
    assert max(b for b, _ in keys) == 48  # 40 sequences of one block each: bucket 48; 49 do not fit
    assert graph_keys(3, 4, 100) == [(1, FIRST_WIDTH), (2, FIRST_WIDTH), (4, FIRST_WIDTH)]


@pytest.mark.parametrize("budget,max_len,seqs,block_size,num_blocks",
                         [(2048, 4096, 64, 16, 14632), (8192, 1 << 20, 1, 16, 70000), (2048, 100, 4, 16, 8),
                          (16, 4096, 64, 16, 2), (4096, 4096, 2, 64, 66)])
def test_prefill_shapes_fit_the_configuration(budget, max_len, seqs, block_size, num_blocks):
    shapes = prefill_shapes(budget, max_len, seqs, block_size, num_blocks)
    assert shapes[0][0] == min(budget, max_len - 1, num_blocks * block_size)
    for query_lens in shapes:
        assert sum(query_lens) <= budget and len(query_lens) <= seqs
        assert all(q < max_len for q in query_lens)
        batch = _prefill_batch(query_lens, block_size, "cpu")  # also checks every row fits its blocks
        used = set(itertools.chain.from_iterable(batch.block_tables))
        assert len(used) == sum(len(t) for t in batch.block_tables) and max(used) < num_blocks
    if seqs > 1 and num_blocks * block_size >= 2 * min(budget, max_len):
        assert any(1 in s for s in shapes)  # a step with decode rows beside the prefill
    if seqs >= 16 and num_blocks >= 16 * 4:
        assert any(len(s) == 16 for s in shapes)  # a step of 16 prompts
    if seqs >= 32 and num_blocks >= 64 and min(budget, max_len - 1) >= 64:
        # a short prompt among decode rows, fewer than 4 tokens a sequence (the indexer's one-query programs)
        few = [s for s in shapes if s.count(1) >= 16]
        assert len(few) == 2 and all(sum(s) < 4 * len(s) for s in few) and {sum(s) % 16 == 0 for s in few} == {0, 1}


def test_warm_up_is_a_no_op_on_the_cpu(tmp_path):
    from flashinfra.engine.runner import ModelRunner
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "tiny", seed=4, tokenizer=False)
    runner = ModelRunner(load_model(path), num_blocks=8, block_size=16, num_slots=2)
    assert warm_up(runner, max_num_seqs=2, max_model_len=128, budget=64, num_blocks=8) is None


def test_with_prefix_caching_every_prompt_shape_also_runs_with_a_checkpoint_inside():
    shapes = prefill_shapes(2048, 4096, 64, 16, 14632)
    assert [(q, c) for q, c in _passes(shapes, None)] == [(q, ()) for q in shapes]
    passes = list(_passes(shapes, 70))
    assert passes[: len(shapes)] == [(q, ()) for q in shapes]
    inside = passes[len(shapes):]
    assert [q for q, _ in inside] == [q for q in shapes if q[0] > 1]
    for query_lens, ckpts in inside:
        assert len(ckpts) == 1 and ckpts[0][0] == 0 and 0 < ckpts[0][1] < query_lens[0] and ckpts[0][2] == 70


def test_prefill_shapes_hold_a_prompt_of_each_power_of_two_below_the_budget_and_one_a_token_shorter():
    shapes = prefill_shapes(2048, 4096, 64, 16, 14632)
    powers = [16, 32, 64, 128, 256, 512, 1024]
    assert [s[0] for s in shapes if len(s) == 1 and s[0] & (s[0] - 1) == 0] == [2048, *powers]
    singles = [s[0] for s in shapes if len(s) == 1]
    assert all(p - 1 in singles for p in powers)  # a count no 16 divides, in every power-of-two class


@pytest.mark.parametrize("longest,seqs,num_blocks,k,want_rows",
                         [(2048, 64, 1000, 3, [1, 3, 16]), (2048, 4, 1000, 3, [1, 3]), (40, 64, 1000, 3, [1, 3]),
                          (2048, 64, 129, 1, [1])])
def test_speculative_warm_up_mixes_a_prompt_with_verify_rows(longest, seqs, num_blocks, k, want_rows):
    """With speculative decoding the warm-up also runs a prompt beside 1, 3 and 16 verify rows of k + 1 tokens (the
    eager step of a request's prompt among others' drafts), each step within the token budget, the batch size and
    the cache, its verify rows in the replay path with one token cached and its prompt starting at 0."""
    from types import SimpleNamespace

    runner = SimpleNamespace(speculator=SimpleNamespace(num_tokens=k), block_size=16)
    steps = list(_mixed_verify_steps(runner, longest, seqs, num_blocks))
    assert [rows for _, rows in steps] == want_rows
    for query_lens, rows in steps:
        assert sum(query_lens) == longest and len(query_lens) == rows + 1 <= seqs
        assert query_lens[1:] == [k + 1] * rows
        batch = _prefill_batch(query_lens, 16, "cpu", rows)
        assert batch.replay == (False,) + (True,) * rows
        assert batch.context_lens == (0,) + (1,) * rows
        assert max(b for t in batch.block_tables for b in t) < num_blocks


def test_index_selects_run_every_threshold_variant_a_long_prompt_meets(monkeypatch):
    """Rows of 16,384 pools and more take the threshold select, whose sample size grows with the row (a constexpr of
    its kernels) and whose pool count Triton specialises on divisibility by 16: the warm-up runs one row length of
    each sample size, one that 16 divides and one it does not, and only up to the configuration's longest row."""
    import types

    from flashinfra.engine.warmup import index_selects
    from flashinfra.kernels import dsa_topk

    seen = []
    monkeypatch.setattr(dsa_topk, "threshold_launch",
                        lambda scores, k, positions=None, kpool=0: seen.append((scores.shape, k, kpool)))
    monkeypatch.setattr(dsa_topk, "sort_launch", lambda scores, k, out=None: None)
    cfg = types.SimpleNamespace(indexer_layers=(3,), index_kpool=4, index_topk=2048)
    assert index_selects(cfg, 1 << 20, 16, 8192, "cpu") == len(seen) + 5 == 17  # and 5 sorts
    pools = [shape[1] for shape, _, _ in seen]
    sizes = [dsa_topk.sample_size(P, 512) for P in pools]
    assert sorted(set(sizes)) == [1024, 2048, 4096] and all(sizes.count(s) == 4 for s in set(sizes))
    assert sorted(P % 16 == 0 for P in pools) == [False] * 6 + [True] * 6
    # one row (the ranking kernels) and two (the sampling ones)
    assert sorted(shape[0] for shape, _, _ in seen) == [1] * 6 + [2] * 6
    assert all(k == 512 and kpool == 4 for shape, k, kpool in seen)
    assert max(pools) <= (1 << 20) // 4
    for P in pools:  # the shortest rows of their sample size, give or take the rounding
        assert dsa_topk.sample_size(P - 16, 512) < dsa_topk.sample_size(P, 512) or P - 16 < dsa_topk.THRESHOLD_MIN_POOLS
    seen.clear()
    assert index_selects(cfg, 128 * 1024, 16, 8192, "cpu") == 9 and len(seen) == 4  # up to 32,768 pools: S 1,024
    assert index_selects(cfg, 32 * 1024, 16, 8192, "cpu") == 5  # 8,192 pools: torch.topk's rows; the sorts
    assert index_selects(types.SimpleNamespace(indexer_layers=()), 1 << 20, 16, 8192, "cpu") == 0


def test_index_selects_run_the_sort_at_every_width_a_step_can_sort(monkeypatch):
    """The sort takes rows of at most 1,024 pools once a step has enough of them (``dsa_topk.route``): 32 prompts of
    250 tokens sort 64 pools, which no warm-up prompt does alone. The warm-up sorts each width a step of the token
    budget can reach, and no narrower one."""
    import types

    from flashinfra.engine.warmup import index_selects
    from flashinfra.kernels import dsa_topk

    seen = []
    monkeypatch.setattr(dsa_topk, "sort_launch", lambda scores, k, out=None: seen.append((*scores.shape, k)))
    cfg = types.SimpleNamespace(indexer_layers=(3,), index_kpool=4, index_topk=2048)  # 512 pools a row at most
    assert index_selects(cfg, 4096, 16, 8192, "cpu") == len(seen) == 5
    assert [(P, k) for _, P, k in seen] == [(64, 64), (128, 128), (256, 256), (512, 512), (1024, 512)]
    assert all(dsa_topk.route(R, P) == "sort" and dsa_topk.route(R - 1, P) == "rank" for R, P, _ in seen)
    seen.clear()
    assert index_selects(cfg, 4096, 16, 2048, "cpu") == 4  # 4,097 rows of 64 pools: past a 2,048-token budget
