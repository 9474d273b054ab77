"""The DSA indexer's registered benchmarks (``flashinfra bench hotpath.dsa_*``, ``bench/hotpath_kernels.py``).

- ``hotpath.dsa_select.*``: the decode step at long context (``b1.n131072.t1``, ``b1.n1048576.t1``) and one
  1024-token prefill chunk at 1M context: the new pools' keys, scoring, top-k and positions, bytes and FLOPs as
  ``checks._dsa_bench`` derives them.
- ``hotpath.dsa_score.*``: the scoring kernel alone: decode and a 256-query slice (``KEY_BUFFER_BYTES``' slice of a
  late prefill step) at 1M, 32 decode rows at 4k.
- The select alone: the sort (``hotpath.dsa_topk_sort.*``, called directly, so also at rows of 2,048 and 4,096 pools
  past ``SORT_MAX_POOLS``), the rank select (``hotpath.dsa_topk_rank.*``, where its compares stay within 4x the
  larger ``RANK_SELECT_COMPARES``) and ``torch.topk`` over the int64 keys (``hotpath.dsa_topk_torch.*``) at the same
  shapes, and ``torch.topk`` beside the threshold select (``hotpath.dsa_topk_threshold.*``) at longer rows; names end in
  ``.k<k>`` where ``k`` is not the model's ``INDEX_TOPK // KPOOL`` (capped at the row length).
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import BenchContext, BenchSpec
from flashinfra.kernels import dsa_indexer, dsa_threshold, dsa_topk
from flashinfra.kernels.check_cases import rnd
from flashinfra.kernels.checks import DI, HI, INDEX_TOPK, KPOOL, _bench, _bench_dev, _dsa_bench


# benchmark family -> (the select, its description)
_TOPK_BENCHES = {
    "dsa_topk_sort": (dsa_topk.sort_launch, "DSA top-k: one sort per row of the int64 sort keys made from the score "
                      "bits"),
    "dsa_topk_rank": (dsa_topk.rank_launch, "DSA top-k: each key ranked by comparison with its row's"),
    "dsa_topk_torch": (dsa_topk.topk_ref, "torch.topk over the int64 sort keys made from the score bits"),
    "dsa_topk_threshold": (dsa_threshold.threshold_launch, "DSA top-k: a sampled threshold per row, the keys above it "
                           "gathered and sorted"),
}


def _topk_bench(R: int, P: int, family: str, k: int | None = None):
    """``family``'s select (``_TOPK_BENCHES``) of the top ``k`` (default the model's ``INDEX_TOPK // KPOOL``, capped
    at ``P``) of ``R`` rows of ``P`` pools, scores ``|randn|`` as ReLU-weighted sums mostly are."""
    fn, description = _TOPK_BENCHES[family]

    def make(ctx: BenchContext) -> BenchSpec:
        dev, _ = _bench_dev(ctx)
        r, p = (min(R, 2), min(P, 4096)) if ctx.quick else (R, P)
        kk = min(k or INDEX_TOPK // KPOOL, p)

        def inputs(seed):
            gen = torch.Generator(device=dev).manual_seed(seed)
            return dsa_topk.score_bits(torch.randn(r, p, device=dev, generator=gen).abs()), torch.empty(
                r, kk, dtype=torch.int64, device=dev)

        moved = 4 * r * p + 8 * r * kk  # the scores read once, the keys written
        return BenchSpec(fn=lambda bits, out: fn(bits, kk, out=out), make_inputs=inputs, bytes=moved,
                         description=description, params=dict(R=r, P=p, k=kk))
    _bench(f"hotpath.{family}.t{R}.p{P}{f'.k{k}' if k else ''}", make)


for _B, _N, _T in ((1, 131072, 1), (1, 1048576, 1), (1, 1048576, 1024)):
    _dsa_bench(_B, _N, _T)


def _score_bench(B: int, ctx_len: int, T: int):
    """The scoring kernel alone: ``T`` queries (``T // B`` of each of ``B`` sequences, the last positions of
    ``ctx_len``) against every pool of their sequence, through a shuffled block table (block size 16)."""
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        b, n, t, hi, di, bs = (min(B, 2), 64, min(T, 4), 16, 16, 16) if ctx.quick else (B, ctx_len, T, HI, DI, 16)
        W, P = n // bs, n // KPOOL

        def inputs(seed):
            torch.manual_seed(seed)
            tables = torch.randperm(b * W, device=dev).view(b, W).to(torch.int32)
            seq = torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(t // b)
            pos = torch.arange(n - t // b, n, dtype=torch.int32, device=dev).repeat(b)
            return (rnd(b * W, bs // KPOOL, di, device=dev, dtype=act), rnd(t, hi, di, device=dev, dtype=act),
                    rnd(t, hi, device=dev), tables, seq, pos, torch.empty(t, P, dtype=torch.int32, device=dev))

        es = act.itemsize
        return BenchSpec(fn=lambda pk, q, w, tb, sq, ps, out: dsa_indexer.scores_launch(pk, q, w, tb, sq, ps, KPOOL,
                                                                                        out),
                         make_inputs=inputs, flops=2 * t * P * hi * di,
                         bytes=b * P * di * es + t * hi * (di * es + 4) + 4 * t * P,  # keys once, q and w, scores
                         description="DSA indexer: every pool's score bits for every query (the scoring kernel)",
                         params=dict(B=b, context=n, T=t, Hi=hi, Di=di))
    _bench(f"hotpath.dsa_score.b{B}.n{ctx_len}.t{T}", make)


# decode at 1M, a slice of a late prefill step at 1M (KEY_BUFFER_BYTES: 256 queries), decode rows of 32 sequences
for _B, _N, _T in ((1, 1048576, 1), (1, 1048576, 256), (32, 4096, 32)):
    _score_bench(_B, _N, _T)

# (rows, pools, k if not the model's), the sort and the rank select beside torch.topk: the decode sizes up to
# SORT_MAX_POOLS, then rows past it (decode at 8k and 16k context, 32 decode rows at 8k, an 8k prefill), to decide
# those limits
for _R, _P, _K in ((1, 64, 32), (1, 256, 32), (16, 256, 32), (1, 1024, None), (128, 1024, None), (1, 2048, None),
                   (32, 2048, None), (1, 4096, None), (8192, 2048, None)):
    for _family in _TOPK_BENCHES:
        if _family != "dsa_topk_rank" or _R * _P * _P <= 4 * dsa_topk.RANK_SELECT_COMPARES[1]:
            _topk_bench(_R, _P, _family, _K)
# longer rows: torch.topk (select's path there) beside the threshold select; 8192 rows of 262,144: a late 8192-token
# prefill step at 1M context; 16 rows: past the rows the threshold select ranks rather than sorts (RANK_MAX_ROWS);
# 8192 rows of 8,192 and 16,384: an early step of a long prompt, about THRESHOLD_MIN_POOLS
for _R, _P in ((1, 32768), (1, 262144), (16, 262144), (256, 262144), (8192, 2048), (8192, 8192), (8192, 16384),
               (8192, 262144)):
    for _family in ("dsa_topk_torch", "dsa_topk_threshold"):
        _topk_bench(_R, _P, _family)
