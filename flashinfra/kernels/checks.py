"""Checks and benchmarks of the hot-path kernels (norms, mHC, MoE routing and fused MoE, DSA indexer,
sparse MLA, the grammar's token bitmask), registered with ``flashinfra.feedback``.

The registered checks (``flashinfra check hotpath``) run the cases of check_cases.py at fixed sizes: on CUDA in
bf16 when there is one, else in float32 under Triton's CPU interpreter in a child process. Benchmarks
(``flashinfra bench hotpath``) time the launchers at GLM-5.3-Flash sizes (``quick``: small), with the bytes each
must move and the FLOPs it must do, for the roofline fractions.
"""

from __future__ import annotations

import random

import torch

from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, register_benchmark, register_check
from flashinfra.kernels import dsa_indexer, dsa_pool_keys, fused_moe as fm, mhc as hc, mhc_expand, norms as nm
from flashinfra.kernels import sparse_mla as sm
from flashinfra.kernels.check_cases import (dsa_select, fused_moe, graph_inputs, moe_align, norms, penalties, rnd,
                                            route, sparse_mla, token_bitmask)
from flashinfra.kernels.cache_write_cases import cache_writes
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter
from flashinfra.kernels.mhc_cases import mhc
from flashinfra.kernels.token_bitmask import apply_token_bitmask_launch

TAGS = ("kernel", "hotpath", "triton")
# GLM-5.3-Flash sizes
D, N_HC, E, TOPK, I_MOE = 4096, 4, 288, 8, 2048
H, R, HI, DI, KPOOL, INDEX_TOPK = 64, 512, 32, 128, 4, 2048
VOCAB = 154880


# ---- registered checks --------------------------------------------------------------------------------


def _registered(name: str, module: str = "flashinfra.kernels.checks"):
    """Register ``fn(device, dtype, seed) -> list[CheckResult]`` as check ``name``: on CUDA in bf16, else
    in float32 under the interpreter (in a child process, importing ``module``, unless this one interprets), with
    a fresh seed that failing results name."""
    def wrap(fn):
        def run() -> list[CheckResult]:
            dev = kernel_device()
            if dev is None:
                return run_in_interpreter(module, name)
            seed = random.randrange(2**31)
            results = fn(dev, torch.bfloat16 if dev == "cuda" else torch.float32, seed)
            for r in results:
                if not r.passed:
                    r.message = (r.message + "; " if r.message else "") + f"seed {seed}"
            return results
        run.__qualname__ = f"check_{name}"
        return register_check(name, tags=TAGS)(run)
    return wrap


@_registered("hotpath.norms")
def _norms(dev, act, seed):
    return norms(dev, *((63, D) if dev == "cuda" else (7, 100)), dtype=act, seed=seed)


@_registered("hotpath.mhc")
def _mhc(dev, act, seed):
    return mhc(dev, *((33, D) if dev == "cuda" else (5, 48)), n=N_HC, dtype=act, seed=seed)


@_registered("hotpath.moe")
def _moe(dev, act, seed):
    T, Em, Dm, Im, k, BM = (37, 64, 1024, 512, TOPK, 16) if dev == "cuda" else (9, 6, 24, 20, 2, 4)
    return (route(dev, T, Em, Dm, k, 2, 1, dtype=act, seed=seed) + moe_align(dev, T, Em, k, BM, seed=seed)
            + fused_moe(dev, T, Em, Dm, Im, k, dtype=act, seed=seed, limit=10.0))


@_registered("hotpath.dsa_select")
def _dsa_select(dev, act, seed):
    if dev == "cuda":
        return dsa_select(dev, [699, 1], [1, 300], Hi=HI, Di=DI, kpool=KPOOL, topk=64, bs=64, seed=seed)
    return dsa_select(dev, [36, 0], [1, 9], kpool=KPOOL, seed=seed)


@_registered("hotpath.cache_writes")
def _cache_writes(dev, act, seed):
    return cache_writes(dev, *((33, R, DI) if dev == "cuda" else (7, 48, 16)), dtype=act, seed=seed)


@_registered("hotpath.sparse_mla")
def _sparse_mla(dev, act, seed):
    if dev == "cuda":
        return sparse_mla(dev, [2999, 66, 899], [1, 1, 1], H=H, R=R, bs=64, S=2051, dtype=act, seed=seed)
    return sparse_mla(dev, [39, 8, 12], [1, 1, 1], seed=seed)


@_registered("hotpath.token_bitmask")
def _token_bitmask(dev, act, seed):
    if dev == "cuda":  # a batch of 64 rows, 37 under a grammar, over GLM-5.3-Flash's vocabulary
        return token_bitmask(dev, 64, VOCAB, 37, dtype=torch.float32, seed=seed)
    return token_bitmask(dev, 9, 1030, 4, vocab_size=1000, seed=seed)


@_registered("hotpath.penalties")
def _penalties(dev, act, seed):
    if dev == "cuda":  # 128 rows, 96 penalized, over GLM-5.3-Flash's vocabulary
        return penalties(dev, 128, VOCAB, 96, 160, seed=seed)
    return penalties(dev, 9, 1030, 5, 12, seed=seed)


@_registered("hotpath.graph_inputs")
def _graph_inputs(dev, act, seed):
    if dev == "cuda":  # a verify step of 100 rows into the 128-row graph, 4 tokens a row, a 1k-block table width
        return graph_inputs(dev, 128, 4, 100, 700, 1024, seed=seed)
    return graph_inputs(dev, 8, 5, 5, 9, 300, seed=seed)


# ---- benchmarks -------------------------------------------------------------------------------------------


def _bench_dev(ctx: BenchContext) -> tuple[str, torch.dtype]:
    dev = "cuda" if ctx.device.startswith("cuda") else "cpu"
    return dev, (ctx.torch_dtype() if dev == "cuda" else torch.float32)


def _bench(name: str, fn):
    fn.__qualname__ = f"bench_{name}"
    register_benchmark(name, tags=TAGS)(fn)


def _fresh(seed: int, *shapes, device, dtype):
    torch.manual_seed(seed)
    return tuple(rnd(*shape, device=device, dtype=dtype) for shape in shapes)


def _norm_bench(T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        t, d = (min(T, 64), 256) if ctx.quick else (T, D)
        w = rnd(d, device=dev, dtype=act)
        es = act.itemsize
        return BenchSpec(fn=lambda x: nm.rms_norm_launch(x, w, 1e-5),
                         make_inputs=lambda seed: _fresh(seed, (t, d), device=dev, dtype=act),
                         bytes=2 * t * d * es + d * es, flops=4 * t * d, description="fused RMSNorm",
                         params=dict(T=t, D=d))
    _bench(f"hotpath.rms_norm.t{T}", make)


def _mhc_bench(T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        t, d = (min(T, 64), 64) if ctx.quick else (T, D)
        n_mix = (2 + N_HC) * N_HC
        fn = rnd(n_mix, N_HC * d, device=dev, dtype=act, scale=(N_HC * d) ** -0.5)
        base, scale = rnd(n_mix, device=dev, scale=0.3), 1 + rnd(3, device=dev, scale=0.3)

        def step(x, out):
            y, post, comb = hc.hc_pre_launch(x, fn, base, scale, N_HC, 20, 1e-6, 1e-5)
            return mhc_expand.hc_post_launch(x, out + y, post, comb)

        es = act.itemsize
        return BenchSpec(fn=step, make_inputs=lambda seed: _fresh(seed, (t, N_HC, d), (t, d), device=dev, dtype=act),
                         bytes=(2 * t * N_HC * d + 2 * t * d) * es + n_mix * N_HC * d * es,
                         flops=2 * t * N_HC * d * n_mix + 4 * t * N_HC * d * (N_HC + 1),
                         description="mHC pre (weights, Sinkhorn, collapse) + post (expand); block output added",
                         params=dict(T=t, D=d, n=N_HC))
    _bench(f"hotpath.mhc.t{T}", make)


def _moe_bench(T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        t, e, d, i, k = (min(T, 16), 8, 64, 32, 2) if ctx.quick else (T, E, D, I_MOE, TOPK)
        w13 = rnd(e, 2 * i, d, device=dev, dtype=act, scale=d**-0.5)
        w2 = rnd(e, d, i, device=dev, dtype=act, scale=i**-0.5)
        s13, s2 = rnd(2 * i, d, device=dev, dtype=act, scale=d**-0.5), rnd(d, i, device=dev, dtype=act, scale=i**-0.5)

        def inputs(seed):
            torch.manual_seed(seed)
            ids = torch.rand(t, e, device=dev).argsort(-1)[:, :k].to(torch.int32)
            return rnd(t, d, device=dev, dtype=act), torch.rand(t, k, device=dev), ids

        touched = e * (1 - (1 - k / e) ** t) + 1  # expected distinct experts under uniform routing, + shared
        es = act.itemsize
        return BenchSpec(fn=lambda x, w, ids: fm.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2),
                         make_inputs=inputs, bytes=int(touched * 3 * i * d * es + 2 * t * d * es),
                         flops=2 * t * (k + 1) * 3 * i * d,
                         description="fused MoE: sorted dispatch, grouped GEMMs with clamped SwiGLU, shared expert",
                         params=dict(T=t, E=e, D=d, I=i, k=k, experts_touched=touched))
    _bench(f"hotpath.moe.t{T}", make)


def _select_inputs(dev, act, B, ctx_len, T, di, bs=64):
    W = -(-ctx_len // bs)
    cache = rnd(B * W, bs, 2 * di, device=dev, dtype=act)
    tables = torch.randperm(B * W, device=dev).view(B, W).to(torch.int32)
    per = T // B
    seq = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(per)
    pos = (torch.arange(ctx_len - per, ctx_len, dtype=torch.int32, device=dev)).repeat(B)
    return cache, tables, torch.full((B,), ctx_len, dtype=torch.int32, device=dev), seq, pos


def _dsa_bench(B: int, ctx_len: int, T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        quick = (min(B, 2), 64, min(B, 2), 16, 16, 16)
        b, n, t, hi, di, topk = quick if ctx.quick else (B, ctx_len, T, HI, DI, INDEX_TOPK)
        ape = rnd(KPOOL, di, device=dev, dtype=act)

        def inputs(seed):
            torch.manual_seed(seed)
            cache, tables, lens, seq, pos = _select_inputs(dev, act, b, n, t, di, bs=64 if not ctx.quick else 16)
            bs = cache.shape[1]
            pool_keys = rnd(cache.shape[0], bs // KPOOL, di, device=dev, dtype=act)  # the earlier steps' pools
            slots = tables.long()[seq.long(), pos.long() // bs] * bs + pos.long() % bs
            return cache, pool_keys, rnd(t, hi, di, device=dev, dtype=act), rnd(t, hi, device=dev), tables, slots, \
                seq, pos

        def step(c, pk, q, w, tb, sl, s, p):  # the pools the new tokens complete, then the selection
            dsa_pool_keys.write_pool_keys_launch(c, None, ape, sl, pk)
            return dsa_indexer.dsa_select(pk, q, w, tb, s, p, KPOOL, topk, True)

        P = n // KPOOL
        pairs = t * P if t == b else b * sum(min(P, (n - t // b + j + 1) // KPOOL) for j in range(t // b))
        es = act.itemsize
        select = dsa_indexer.select_bytes(t, P, min(topk // KPOOL, P))  # the scores, the top-k's traffic
        return BenchSpec(fn=step, make_inputs=inputs,
                         bytes=b * P * di * es + t * (2 * di + di // KPOOL) * es + select,
                         flops=2 * pairs * hi * di,
                         description="DSA indexer: new pools' keys, scores over the pool-key cache, top-k, positions",
                         params=dict(B=b, context=n, T=t, Hi=hi, Di=di))
    _bench(f"hotpath.dsa_select.b{B}.n{ctx_len}.t{T}", make)


def _mla_bench(B: int, ctx_len: int, T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        b, n, t, h, r = (min(B, 2), 64, min(B, 2), 4, 32) if ctx.quick else (B, ctx_len, T, H, R)
        bs = 64 if not ctx.quick else 16
        S = min(INDEX_TOPK, n) + KPOOL - 1

        def inputs(seed):
            torch.manual_seed(seed)
            W = -(-n // bs)
            latent = rnd(b * W, bs, r, device=dev, dtype=act)
            tables = torch.randperm(b * W, device=dev).view(b, W).to(torch.int32)
            per = t // b
            pos = torch.arange(n - per, n, device=dev).repeat(b)
            sel = (torch.rand(t, S, device=dev) * (pos[:, None] + 1)).long()  # anything the query can see
            return rnd(t, h, r, device=dev, dtype=act), latent, sel.to(torch.int32), \
                torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(per), tables

        rows = t * S
        return BenchSpec(fn=lambda q, lat, sel, seq, tb: sm.sparse_mla_launch(q, lat, sel, seq, tb, 256**-0.5),
                         make_inputs=inputs, bytes=min(rows, b * n) * r * act.itemsize + 2 * t * h * r * act.itemsize,
                         flops=4 * rows * h * r, description="absorbed sparse MLA over the paged latent",
                         params=dict(B=b, context=n, T=t, H=h, R=r, selected=S))
    _bench(f"hotpath.sparse_mla.b{B}.n{ctx_len}.t{T}", make)


def _token_bitmask_bench(B: int, R: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, _ = _bench_dev(ctx)
        n, r, v = (min(B, 8), min(R, 4), 4096) if ctx.quick else (B, R, VOCAB)
        W = -(-v // 32)

        def inputs(seed):
            gen = torch.Generator(device=dev).manual_seed(seed)
            rows = torch.randperm(n, device=dev, generator=gen)[:r].to(torch.int32)
            bitmask = torch.randint(-2**31, 2**31 - 1, (r, W), dtype=torch.int32, device=dev, generator=gen)
            return torch.randn(n, v, device=dev, generator=gen), bitmask, rows

        return BenchSpec(fn=lambda logits, bitmask, rows: apply_token_bitmask_launch(logits, bitmask, rows, v),
                         make_inputs=inputs, bytes=r * W * 4 + r * v * 4 // 2,
                         description="grammar token bitmask on the constrained rows' float32 logits (half masked)",
                         params=dict(B=n, rows=r, V=v))
    _bench(f"hotpath.token_bitmask.b{B}.r{R}", make)


for _T in (1, 128, 8192):
    _norm_bench(_T)
    _mhc_bench(_T)
for _T in (1, 32, 128, 8192):
    _moe_bench(_T)
for _B in (1, 32, 128):
    _dsa_bench(_B, 4096, _B)
    _mla_bench(_B, 4096, _B)
_dsa_bench(1, 8192, 8192)
_mla_bench(1, 8192, 8192)
_token_bitmask_bench(64, 64)
