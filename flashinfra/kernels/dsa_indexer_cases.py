"""Check cases and benchmarks of the DSA indexer's pool-key cache and sliced selection
(``kernels.dsa_pool_keys``, ``kernels.dsa_indexer``), beside the float cases of ``flashinfra.kernels.check_cases``.

- ``select_over_entries``: what a case needs to run ``dsa_select`` over a filled entry cache: a pool-key cache
  poisoned with NaN, then every complete pool's key written by the kernel.
- ``pool_keys_write``: the write kernel against the float64 definition and the reference write, rows no token
  completed left untouched (poisoned), bf16/float or e4m3 entries.
- ``dsa_select_steps``: a request prefilled in chunks then decoded, and a second request hitting its prefix
  (its first blocks, whose pools an earlier step wrote), through the model's own cache writes
  (``quant.cache.write_index_entries``) into poisoned caches; each step's selection against ``Indexer.select``
  (near-ties allowed as in ``check_cases.dsa_select``), and every pool key of the cache against the definition.
- ``dsa_select_sliced``: the selection with the queries in slices of a few rows equals one pass, bit for bit.
- ``dsa_positions``: the positions kernel (top-k sort keys -> token lists) against its reference, bit for bit,
  the tail last and first, poisoned output.
- ``topk_select``: the sort (``dsa_topk.sort_launch``), the rank select (``dsa_topk.rank_launch``), the threshold
  select (``dsa_threshold.threshold_launch``) or ``dsa_topk.select`` (one of them or ``torch.topk``, by rows and row
  length) against ``torch.topk`` over
  the int64 sort keys, bit for bit (values and order), on rows built to tie: a few score values with ±0 and ±inf,
  all equal, all zero, fewer visible pools than ``k`` (the rest at the float32 minimum, as the scorer writes pools a
  query cannot see), equal high bits with ties in the low bits, continuous scores, arbitrary bits.
- ``topk_threshold_counts``: the threshold select's thresholds and counts against counts made by torch.
- ``topk_threshold_fallback``: the threshold select's exact path alone (every row sent there), bit for bit.
- ``dsa_select_topk``: the indexer's selection (scores, then ``dsa_topk.select`` on whichever path the row length
  or the replaced limits give) against ``torch.topk`` over the same scores' keys, bit for bit.

Registered checks ``hotpath.dsa_pool_keys`` (the first five cases) and ``hotpath.dsa_topk`` (the last four), at
fixed sizes. The DSA benchmarks are ``dsa_benches``'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from flashinfra.feedback.registry import CheckResult, compare, poison_
from flashinfra.kernels import dsa_indexer, dsa_threshold, dsa_topk
from flashinfra.kernels.check_cases import (_d, _gen, _not_near_tie, _verdict, paged_cache, quantized_cache, rnd,
                                             select_over_entries, slots_of, tol)
from flashinfra.kernels.checks import DI, HI, INDEX_TOPK, KPOOL, _registered
from flashinfra.kernels.dsa_pool_keys import compress_pools, dequant_entries, write_pool_keys_launch, \
    write_pool_keys_ref
from flashinfra.kernels.launch import next_power_of_2


def _pools_of(flat: torch.Tensor, scale, slots: torch.Tensor, kpool: int, ape, dtype) -> torch.Tensor:
    """float64 keys of the pools whose last slots are ``slots`` (entries dequantized to ``dtype`` first)."""
    rows = (slots[:, None] - (kpool - 1) + torch.arange(kpool, device=slots.device)).flatten()
    e = dequant_entries(flat[rows], None if scale is None else scale.view(-1, 2)[rows], dtype)
    return compress_pools(_d(e).view(-1, kpool, e.shape[-1]), _d(ape))


def pool_keys_write(device: str, T: int, Di=16, kpool=4, bs=8, fp8=False, dtype=torch.float32,
                    seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    blocks = -(-2 * T // bs) + 2
    cache = rnd(blocks, bs, 2 * Di, device=device, gen=gen, dtype=dtype)
    scale = None
    if fp8:
        cache, scale, _ = quantized_cache(cache, "fp8", Di)
    ape = rnd(kpool, Di, device=device, gen=gen, dtype=dtype)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(seed))[:T].to(device)
    slots[::3] = -1  # padding: no token
    out = poison_(torch.empty(blocks, bs // kpool, Di, dtype=dtype, device=device))
    ref = poison_(torch.empty_like(out))
    write_pool_keys_launch(cache, scale, ape, slots, out)
    write_pool_keys_ref(cache, scale, ape, slots, ref)
    done = slots[(slots >= 0) & ((slots + 1) % kpool == 0)]
    flat_out, flat_ref = out.view(-1, Di), ref.view(-1, Di)
    untouched = torch.ones(flat_out.shape[0], dtype=torch.bool, device=device)
    untouched[done // kpool] = False
    want = _pools_of(cache.view(-1, 2 * Di), scale, done, kpool, ape, dtype)
    name = f"dsa_pool_keys.{'fp8' if fp8 else str(dtype).removeprefix('torch.')}"
    return [compare(f"{name}.written", flat_out[done // kpool], want, **tol(dtype)),
            compare(f"{name}.reference_write", flat_ref[done // kpool], want, **tol(dtype)),
            _verdict(f"{name}.untouched", bool(flat_out[untouched].isnan().all()) and len(done) > 0,
                     f"{int((~flat_out[untouched].isnan()).sum())} values written in pools no token completed, "
                     f"{len(done)} pools completed")]


def dsa_select_steps(device: str, steps: list[list[tuple[int, int, int]]], prefix_blocks: int, Hi=16, Di=16,
                     kpool=4, topk=8, bs=8, fp8=False, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """``steps``: per step the (sequence, start, end) positions it computes; sequence 1 shares sequence 0's first
    ``prefix_blocks`` blocks (a prefix-cache hit: its steps start at or after ``prefix_blocks * bs``)."""
    from flashinfra.config import TextConfig
    from flashinfra.model.indexer import Indexer
    from flashinfra.quant.cache import read_index_entries, write_index_entries

    gen = _gen(device, seed)
    lens = [max(e for s in steps for b, _, e in s if b == seq) for seq in (0, 1)]
    _, tables = paged_cache(device, gen, lens, bs, 1, dtype)
    tables[1, :prefix_blocks] = tables[0, :prefix_blocks]
    entries = [rnd(n, 2 * Di, device=device, gen=gen, dtype=dtype) for n in lens]
    entries[1][: prefix_blocks * bs] = entries[0][: prefix_blocks * bs]  # the same prompt tokens
    blocks = int(tables.max()) + 1
    cache = SimpleNamespace(indexer_keys={0: poison_(torch.empty(blocks, bs, 2 * Di, dtype=dtype, device=device))},
                            indexer_scale={}, indexer_pool_keys={0: poison_(torch.empty(blocks, bs // kpool, Di,
                                                                                        dtype=dtype, device=device))})
    if fp8:
        cache.indexer_keys[0] = torch.zeros(blocks, bs, 2 * Di, dtype=torch.float8_e4m3fn, device=device)
        cache.indexer_scale[0] = poison_(torch.empty(blocks, bs, 2, device=device))
    cfg = TextConfig(index_n_heads=Hi, index_head_dim=Di, index_kpool=kpool, index_topk=topk, hidden_size=32,
                     q_lora_rank=16)
    ix = Indexer(cfg, dtype).to(device)
    ix.pool_ape.copy_(rnd(kpool, Di, device=device, gen=gen, dtype=dtype))
    T_all, differ, unexplained = 0, 0, []
    for step in steps:
        slots = torch.cat([slots_of(tables, b, s, e, bs) for b, s, e in step])
        write_index_entries(cache, 0, slots, torch.cat([entries[b][s:e] for b, s, e in step]), ix.pool_ape)
        T = sum(e - s for _, s, e in step)
        q, w = rnd(T, Hi, Di, device=device, gen=gen, dtype=dtype), rnd(T, Hi, device=device, gen=gen)
        token_seq = torch.tensor([b for b, s, e in step for _ in range(s, e)], dtype=torch.int32, device=device)
        positions = torch.tensor([p for _, s, e in step for p in range(s, e)], dtype=torch.int32, device=device)
        sel = dsa_indexer.dsa_select(cache.indexer_pool_keys[0], q, w, tables, token_seq, positions, kpool, topk,
                                     True)
        at = 0
        for b, s, e in step:
            seen = read_index_entries(cache, 0, tuple(tables[b].tolist()), e, dtype)
            mask = ix.select(seen, q[at:at + e - s], w[at:at + e - s])
            for i in range(e - s):
                got = sorted(p for p in sel[at + i].tolist() if p >= 0)
                if got != torch.nonzero(mask[i]).flatten().tolist():
                    differ += 1
                    why = _not_near_tie(got, torch.nonzero(mask[i]).flatten().tolist(), seen, q[at + i],
                                        w[at + i], ix, s + i, topk, kpool)
                    if why:
                        unexplained.append(why)
            at += e - s
        T_all += T
    allowed = max(1, T_all // 50)
    name = f"dsa_select.steps{'.fp8_cache' if fp8 else ''}"
    results = [_verdict(f"{name}.positions", differ <= allowed and not unexplained,
                        "; ".join([f"{differ} of {T_all} queries differ from Indexer.select (allowed {allowed}, "
                                   "at near-ties only)", *unexplained[:4]]))]
    flat = cache.indexer_pool_keys[0].view(-1, Di)
    done = torch.cat([slots_of(tables, b, 0, n - n % kpool, bs)[kpool - 1::kpool] for b, n in enumerate(lens)])
    want = _pools_of(cache.indexer_keys[0].view(-1, 2 * Di), cache.indexer_scale.get(0), done, kpool, ix.pool_ape,
                     dtype)
    results.append(compare(f"{name}.pool_keys", flat[done // kpool], want, **tol(dtype)))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched[done // kpool] = False
    results.append(_verdict(f"{name}.untouched", bool(flat[untouched].isnan().all()),
                            "pool rows no token completed keep their poison"))
    return results


def dsa_select_sliced(device: str, ctx: list[int], qlens: list[int], rows: int, Hi=16, Di=16, kpool=4, topk=8,
                      bs=8, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """The selection with ``KEY_BUFFER_BYTES`` holding ``rows`` queries' scores equals the one-pass selection."""
    gen = _gen(device, seed)
    lens = [c + n for c, n in zip(ctx, qlens)]
    cache, tables = paged_cache(device, gen, lens, bs, 2 * Di, dtype)
    T = sum(qlens)
    q, w = rnd(T, Hi, Di, device=device, gen=gen, dtype=dtype), rnd(T, Hi, device=device, gen=gen)
    ape = rnd(kpool, Di, device=device, gen=gen, dtype=dtype)
    token_seq = torch.tensor([b for b, n in enumerate(qlens) for _ in range(n)], dtype=torch.int32, device=device)
    positions = torch.tensor([p for c, n in zip(ctx, qlens) for p in range(c, c + n)], dtype=torch.int32,
                             device=device)
    args = (cache, None, ape, q, w, tables, lens, token_seq, positions, kpool, topk)
    whole = select_over_entries(*args)
    budget = dsa_indexer.KEY_BUFFER_BYTES
    dsa_indexer.KEY_BUFFER_BYTES = rows * 4 * tables.shape[1] * bs // kpool
    try:
        sliced = select_over_entries(*args)
    finally:
        dsa_indexer.KEY_BUFFER_BYTES = budget
    return [compare("dsa_select.sliced", sliced, whole, atol=0, rtol=0)]


def dsa_positions(device: str, T: int, k: int, kpool=4, tail=3, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    positions = torch.randint(0, 4 * (k + 1) * kpool, (T,), generator=gen, device=device, dtype=torch.int32)
    pools = torch.randint(0, 4 * k + 1, (T, k), generator=gen, device=device)
    top = (torch.randint(-2**31, 2**31 - 1, (T, k), generator=gen, device=device) << 32) | pools  # any high word
    out = []
    for first in (False, True):
        got = dsa_indexer.positions_launch(top, positions, kpool, k, tail, first,
                                           out=torch.full((T, k * kpool + tail), -7, dtype=torch.int32, device=device))
        want = dsa_indexer.positions_ref(top, positions, kpool, k, tail, first)
        out.append(compare(f"dsa_positions.{'tail_first' if first else 'tail_last'}", got, want, atol=0, rtol=0))
    return out


def _tie_rows(device: str, gen, P: int, k: int) -> dict[str, torch.Tensor]:
    """[P] int32 score bits per kind of row."""
    fmin = torch.finfo(torch.float32).min
    few = torch.tensor([0.0, -0.0, 0.5, 1.0, 2.5, -3.0, float("inf"), float("-inf")], device=device)
    pick = torch.randint(0, len(few), (P,), generator=gen, device=device)
    visible = torch.full((P,), fmin, device=device)
    v = max(1, k // 2)  # fewer visible pools than k: the earliest, as a query's position leaves them
    visible[:v] = few[pick[:v]]
    one = dsa_topk.score_bits(torch.ones(1, device=device))
    bits = torch.randint(-2**31, 2**31 - 1, (P,), generator=gen, device=device, dtype=torch.int64).to(torch.int32)
    bits[: min(P, 2)] = torch.tensor([-2**31, 2**31 - 1], device=device, dtype=torch.int32)[: min(P, 2)]
    return {"few_values": dsa_topk.score_bits(few[pick]),
            "all_equal": one.expand(P).clone(),
            "signed_zeros": dsa_topk.score_bits(torch.where(pick % 2 == 0, 0.0, -0.0)),
            "few_visible": dsa_topk.score_bits(visible),
            "low_bits": one + torch.randint(0, 3000, (P,), generator=gen, device=device, dtype=torch.int32),
            "continuous": dsa_topk.score_bits(torch.randn(P, generator=gen, device=device).abs()),
            "any_bits": bits}


def _same_keys(name: str, got: torch.Tensor, want: torch.Tensor) -> CheckResult:
    rows = (got != want).any(1).nonzero().flatten().tolist()
    return _verdict(name, got.shape == want.shape and not rows,
                    f"{len(rows)} of {want.shape[0]} rows differ from torch.topk's keys (first: {rows[:4]})")


@contextmanager
def _limits(sort_max: int | None, threshold_min: int | None, rank_max: int | None = None,
            rank_compares: int | None = None):
    """``dsa_topk.select``'s limits ``SORT_MAX_POOLS``, ``THRESHOLD_MIN_POOLS`` and ``RANK_SELECT_COMPARES`` and the
    threshold select's ``RANK_MAX_ROWS`` replaced inside the block where given."""
    rank_compares = None if rank_compares is None else (rank_compares, rank_compares)
    limits = ((dsa_topk, "SORT_MAX_POOLS", sort_max), (dsa_topk, "THRESHOLD_MIN_POOLS", threshold_min),
              (dsa_threshold, "RANK_MAX_ROWS", rank_max), (dsa_topk, "RANK_SELECT_COMPARES", rank_compares))
    saved = [getattr(m, n) for m, n, _ in limits]
    for m, n, v in limits:
        if v is not None:
            setattr(m, n, v)
    try:
        yield
    finally:
        for (m, n, _), v in zip(limits, saved):
            setattr(m, n, v)


def _tie_scores(device: str, P: int, k: int, rows_per_kind: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """The kinds of ``_tie_rows`` and their rows stacked [kinds * rows_per_kind, P], each kind's rows together."""
    gen = _gen(device, seed)
    kinds = [_tie_rows(device, gen, P, k) for _ in range(rows_per_kind)]
    names = list(kinds[0])
    return names, torch.stack([row[n] for n in names for row in kinds])


def topk_select(device: str, P: int, k: int, rows_per_kind=1, path="sort", sort_max: int | None = None,
                threshold_min: int | None = None, rank_compares: int | None = None, seed=0) -> list[CheckResult]:
    """``path``: ``dsa_topk.sort_launch`` ("sort"), ``dsa_topk.rank_launch`` ("rank"),
    ``dsa_threshold.threshold_launch`` with one program a row ("threshold") or the few rows' ranks
    ("threshold_ranked"), or ``dsa_topk.select`` ("select", with ``sort_max``, ``threshold_min`` and
    ``rank_compares`` replacing its limits), on every kind of ``_tie_rows`` (``rows_per_kind`` fresh rows each) into
    a poisoned output, against ``topk_ref``."""
    names, scores = _tie_scores(device, P, k, rows_per_kind, seed)
    out = poison_(torch.empty(len(scores), k, dtype=torch.int64, device=device))
    if path in ("sort", "rank"):
        got = (dsa_topk.sort_launch if path == "sort" else dsa_topk.rank_launch)(scores, k, out=out)
    elif path in ("threshold", "threshold_ranked"):  # the sorts of a row's sample and candidates, or ranks
        with _limits(None, None, rank_max=len(scores) if path == "threshold_ranked" else 0):
            got = dsa_threshold.threshold_launch(scores, k, out=out)
    else:
        with _limits(sort_max, threshold_min, rank_compares=rank_compares):
            got = dsa_topk.select(scores, k, out)
            path = f"select_{dsa_topk.route(len(scores), P)}"
    want = dsa_topk.topk_ref(scores, k)
    r = rows_per_kind
    return [_same_keys(f"dsa_topk.{path}.{n}", got[i * r:(i + 1) * r], want[i * r:(i + 1) * r])
            for i, n in enumerate(names)]


def topk_threshold_counts(device: str, P: int, k: int, rows_per_kind=1, seed=0) -> list[CheckResult]:
    """``dsa_threshold.threshold_counts``: the thresholds decrease along each row, and each count equals the number of
    the row's keys above its threshold, counted by torch, on every kind of ``_tie_rows``."""
    names, scores = _tie_scores(device, P, k, rows_per_kind, seed)
    keys = (scores.long() << 32) | torch.arange(P, device=device)
    out, picked = [], []
    for how, rank_max in (("sorted", 0), ("ranked", len(scores))):  # the sample's sort, or its ranks
        with _limits(None, None, rank_max):
            thresholds, counts = dsa_threshold.threshold_counts(scores, k)
        picked.append(thresholds)
        want = (keys[:, None, :] > thresholds[:, :, None]).sum(-1).to(torch.int32)
        decreasing = bool((thresholds[:, 1:] <= thresholds[:, :-1]).all())
        wrong = (counts != want).any(1).nonzero().flatten().tolist()
        out.append(_verdict(f"dsa_topk.threshold_counts.{how}", decreasing and not wrong,
                            f"{len(wrong)} of {len(scores)} rows' counts differ (first: {wrong[:4]}); thresholds "
                            f"{'' if decreasing else 'not '}decreasing"))
    same = bool((picked[0] == picked[1]).all())
    return out + [_verdict("dsa_topk.threshold_ranks_as_sorted", same,
                           f"the sample's ranks {'pick the same' if same else 'pick other'} thresholds as its sort")]


def topk_threshold_fallback(device: str, P: int, k: int, cap: int, seed=0) -> list[CheckResult]:
    """``dsa_threshold.threshold_finish_kernel`` with every row's counts at zero (no threshold has ``k`` keys above it),
    so every row takes the exact path: chunks of ``cap - KB`` keys sorted beside the running top ``k``, into a
    poisoned output, against ``topk_ref`` on every kind of ``_tie_rows``."""
    names, scores = _tie_scores(device, P, k, 1, seed)
    R, M, KB = len(scores), dsa_threshold.THRESHOLDS, next_power_of_2(k)
    out = poison_(torch.empty(R, k, dtype=torch.int64, device=device))
    counts = torch.zeros(R, M, dtype=torch.int32, device=device)
    cand = torch.empty(R, cap, dtype=torch.int64, device=device)
    dsa_threshold.threshold_finish_kernel[(R,)](scores, scores, counts, cand, out, P, k, M=M, CAP=cap, KB=KB, KP=0,
                                           EXACT_ONLY=False)
    want = dsa_topk.topk_ref(scores, k)
    return [_same_keys(f"dsa_topk.threshold_exact.{n}", out[i:i + 1], want[i:i + 1]) for i, n in enumerate(names)]


def dsa_select_topk(device: str, ctx: list[int], qlens: list[int], Hi=16, Di=16, kpool=4, topk=8, bs=8,
                    sort_max: int | None = None, threshold_min: int | None = None, dtype=torch.float32,
                    wider: int = 1, rank_max: int | None = None, rank_compares: int | None = None,
                    seed=0) -> list[CheckResult]:
    """``dsa_indexer.select_pools`` (scores, then ``dsa_topk.select``) equals ``torch.topk`` over the int64 keys of
    the scores the scoring kernel writes, bit for bit, over a random pool-key cache; ``sort_max`` and
    ``threshold_min`` replace ``select``'s limits (``sort_max=0``: no row takes the sort; ``rank_compares=0``: none
    the rank select), ``rank_max`` the threshold select's ``RANK_MAX_ROWS``; ``wider``: the block tables that many
    times wider than the longest sequence needs, zero-padded (a CUDA graph's width bucket)."""
    gen = _gen(device, seed)
    lens = [c + n for c, n in zip(ctx, qlens)]
    _, tables = paged_cache(device, gen, lens, bs, 1, dtype)
    tables = torch.nn.functional.pad(tables, (0, (wider - 1) * tables.shape[1]))
    pool_keys = rnd(int(tables.max()) + 1, bs // kpool, Di, device=device, gen=gen, dtype=dtype)
    T = sum(qlens)
    q, w = rnd(T, Hi, Di, device=device, gen=gen, dtype=dtype), rnd(T, Hi, device=device, gen=gen)
    token_seq = torch.tensor([b for b, n in enumerate(qlens) for _ in range(n)], dtype=torch.int32, device=device)
    positions = torch.tensor([p for c, n in zip(ctx, qlens) for p in range(c, c + n)], dtype=torch.int32,
                             device=device)
    P = tables.shape[1] * bs // kpool
    k = min(topk // kpool, P)
    with _limits(sort_max, threshold_min, rank_max, rank_compares):
        got = dsa_indexer.select_pools(pool_keys, q, w, tables, token_seq, positions, kpool, k)
    scores = poison_(torch.empty(T, P, dtype=torch.int32, device=device))
    dsa_indexer.scores_launch(pool_keys, q, w, tables, token_seq, positions, kpool, scores)
    return [_same_keys(f"dsa_select.topk{f'.wider{wider}' if wider > 1 else ''}", got, dsa_topk.topk_ref(scores, k))]


@_registered("hotpath.dsa_pool_keys", __name__)
def _dsa_pool_keys(dev, act, seed):
    if dev == "cuda":
        real = dict(Hi=HI, Di=DI, kpool=KPOOL, bs=64)
        steps = [[(0, 0, 301)], [(0, 301, 700)], [(0, 700, 701), (1, 640, 903)], [(0, 701, 702), (1, 903, 904)]]
        return (pool_keys_write(dev, 1000, Di=DI, kpool=KPOOL, bs=64, dtype=act, seed=seed)
                + dsa_select_steps(dev, steps, 10, topk=256, dtype=act, seed=seed, **real)
                + dsa_select_sliced(dev, [0, 2100], [333, 1], 37, topk=512, dtype=act, seed=seed, **real)
                + dsa_positions(dev, 300, 512, seed=seed))
    steps = [[(0, 0, 13)], [(0, 13, 30)], [(0, 30, 31), (1, 24, 33)], [(0, 31, 32), (1, 33, 34)]]
    return (pool_keys_write(dev, 29, seed=seed) + dsa_select_steps(dev, steps, 3, seed=seed)
            + dsa_select_sliced(dev, [0, 30], [13, 7], 3, seed=seed) + dsa_positions(dev, 7, 5, seed=seed))


@_registered("hotpath.dsa_topk", __name__)
def _dsa_topk(dev, act, seed):
    if dev == "cuda":
        real = dict(Hi=HI, Di=DI, kpool=KPOOL, bs=64)
        return (topk_select(dev, 1024, 512, rows_per_kind=3, seed=seed)
                + topk_select(dev, 300, 32, rows_per_kind=2, seed=seed)
                + topk_select(dev, 1024, 512, path="select", rank_compares=0, seed=seed)
                + topk_select(dev, 2048, 512, rows_per_kind=3, path="select", rank_compares=0, seed=seed)
                + topk_select(dev, 2048, 512, rows_per_kind=2, path="select", seed=seed)  # the rank select
                + topk_select(dev, 300, 32, path="rank", seed=seed)
                + topk_select(dev, 262144, 512, path="select", seed=seed)
                + topk_select(dev, 262144, 512, rows_per_kind=3, path="threshold", seed=seed)
                + topk_select(dev, 16385, 512, rows_per_kind=3, path="threshold", seed=seed)
                + topk_select(dev, 262144, 512, path="threshold_ranked", seed=seed)
                + topk_select(dev, 16385, 512, rows_per_kind=2, path="threshold_ranked", seed=seed)
                + topk_threshold_fallback(dev, 20000, 512, 2048, seed=seed)
                + topk_threshold_counts(dev, 262144, 512, seed=seed)
                + dsa_select_topk(dev, [70000, 0], [1, 200], topk=INDEX_TOPK, dtype=act, seed=seed, **real)
                + dsa_select_topk(dev, [3000, 0], [1, 100], topk=INDEX_TOPK, dtype=act, seed=seed, **real)
                + dsa_select_topk(dev, [3000, 0], [1, 100], topk=INDEX_TOPK, dtype=act, rank_compares=1 << 30,
                                  seed=seed, **real)
                + dsa_select_topk(dev, [3000, 1000], [1, 1], topk=INDEX_TOPK, dtype=act, wider=4, seed=seed, **real)
                + dsa_select_topk(dev, [70000, 30000], [1, 1], topk=INDEX_TOPK, dtype=act, wider=4, seed=seed, **real)
                + dsa_select_topk(dev, [70000, 30000], [1, 1], topk=INDEX_TOPK, dtype=act, wider=4, rank_max=0,
                                  seed=seed, **real))
    return (topk_select(dev, 37, 5, seed=seed) + topk_select(dev, 259, 5, path="select", seed=seed)
            + topk_select(dev, 37, 5, path="rank", seed=seed) + topk_select(dev, 20, 20, path="rank", seed=seed)
            + topk_select(dev, 259, 5, path="select", rank_compares=0, seed=seed)
            + topk_select(dev, 259, 5, path="select", sort_max=64, rank_compares=0, seed=seed)
            + topk_select(dev, 259, 5, path="select", sort_max=64, threshold_min=256, seed=seed)
            + topk_select(dev, 130, 5, path="threshold", seed=seed)  # a sample of 128 keys
            + topk_select(dev, 20, 20, path="threshold", seed=seed)  # k = P: the minimum key's row is done exactly
            + topk_select(dev, 130, 5, path="threshold_ranked", seed=seed)
            + topk_select(dev, 20, 20, path="threshold_ranked", seed=seed)
            + topk_threshold_fallback(dev, 100, 8, 32, seed=seed)
            + topk_threshold_counts(dev, 300, 8, seed=seed)
            + dsa_select_topk(dev, [40, 3], [1, 6], seed=seed)
            + dsa_select_topk(dev, [40, 3], [1, 6], rank_compares=0, seed=seed)
            + dsa_select_topk(dev, [40, 3], [1, 6], sort_max=0, rank_compares=0, seed=seed)
            + dsa_select_topk(dev, [60, 30, 3], [1, 1, 1], wider=4, seed=seed)
            + dsa_select_topk(dev, [40, 3], [1, 6], sort_max=0, threshold_min=8, seed=seed)
            + dsa_select_topk(dev, [60, 30, 3], [1, 1, 1], sort_max=0, threshold_min=8, wider=4, seed=seed)
            + dsa_select_topk(dev, [60, 30, 3], [1, 1, 1], sort_max=0, threshold_min=8, wider=4, rank_max=0,
                              seed=seed))
