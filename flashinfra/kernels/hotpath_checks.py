"""Checks and benchmarks of the hot-path kernels (norms, mHC, MoE, DSA indexer, sparse MLA), registered with
``flashinfra.feedback``.

Checks (``flashinfra check hotpath``) run each launcher on fresh random inputs at odd sizes, outputs
poisoned where the launcher takes them, against its reference in float64: on CUDA when there is one, else
under Triton's CPU interpreter in a child process (``python -m flashinfra.kernels.hotpath_checks NAME``).
Benchmarks (``flashinfra bench hotpath``) time the launchers at GLM-5.3-Flash sizes (``quick``: small),
with the bytes each must move and the FLOPs it must do, for the roofline fractions; derivations in
``bench/notes/<op>.md``.
"""

from __future__ import annotations


import torch

from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, compare, poison_, \
    register_benchmark, register_check
from flashinfra.kernels import dsa_indexer, fused_moe, mhc, moe_route, norms, sparse_mla
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter

TAGS = ("kernel", "hotpath", "triton")
# GLM-5.3-Flash sizes
D, N_HC, E, TOPK, I_MOE = 4096, 4, 288, 8, 2048
H, R, HI, DI, KPOOL, INDEX_TOPK = 64, 512, 32, 128, 4, 2048






def _checked(name: str):
    """Register ``fn(dev, act_dtype)`` as check ``name``, run where the kernels can run."""
    def wrap(fn):
        def run() -> list[CheckResult]:
            dev = kernel_device()
            if dev is None:
                return run_in_interpreter("flashinfra.kernels.hotpath_checks", name)
            return fn(dev, torch.bfloat16 if dev == "cuda" else torch.float32)
        run.__qualname__ = f"check_{name}"
        return register_check(name, tags=TAGS)(run)
    return wrap


def _rnd(*shape, dev, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=dev) * scale).to(dtype)


def _d(t):
    return t.double()


@_checked("hotpath.norms")
def check_norms(dev, act):
    T, Dn = (63, 4096) if dev == "cuda" else (7, 100)
    x, g, w = _rnd(T, Dn, dev=dev, dtype=act), _rnd(T, Dn, dev=dev, dtype=act), _rnd(Dn, dev=dev, dtype=act)
    out = poison_(torch.empty_like(x))
    norms.rms_norm_launch(x, w, 1e-5, out=out)
    gout = poison_(torch.empty_like(x))
    norms.gated_rms_norm_launch(x, g, w, 1e-5, out=gout)
    return [compare("hotpath.norms.rms", out, norms.rms_norm_ref(_d(x), _d(w), 1e-5), dtype=act),
            compare("hotpath.norms.gated", gout, norms.gated_rms_norm_ref(_d(x), _d(g), _d(w), 1e-5), dtype=act)]


@_checked("hotpath.mhc")
def check_mhc(dev, act):
    T, Dm = (33, D) if dev == "cuda" else (5, 48)
    x = _rnd(T, N_HC, Dm, dev=dev, dtype=act)
    fn = _rnd((2 + N_HC) * N_HC, N_HC * Dm, dev=dev, dtype=act, scale=(N_HC * Dm) ** -0.5)
    base, scale = _rnd((2 + N_HC) * N_HC, dev=dev, scale=0.3), 1 + _rnd(3, dev=dev, scale=0.3)
    y, post, comb = mhc.hc_pre_launch(x, fn, base, scale, N_HC, 20, 1e-6, 1e-5)
    ry, rpost, rcomb = mhc.hc_pre_ref(_d(x), _d(fn), _d(base), _d(scale), N_HC, 20, 1e-6, 1e-5)
    out = _rnd(T, Dm, dev=dev, dtype=act)
    new = mhc.hc_post_launch(x, out, post, comb)
    wt = dict(atol=2e-3, rtol=2e-3) if act == torch.bfloat16 else {}
    return [compare("hotpath.mhc.post_weights", post, rpost, **wt), compare("hotpath.mhc.comb", comb, rcomb, **wt),
            compare("hotpath.mhc.collapsed", y, ry, dtype=act),
            compare("hotpath.mhc.expand", new, mhc.hc_post_ref(_d(x), _d(out), rpost, rcomb), dtype=act)]


@_checked("hotpath.moe")
def check_moe(dev, act):
    T, Em, Dm, Im, k = (37, 64, 1024, 512, TOPK) if dev == "cuda" else (9, 6, 24, 20, 2)
    x = _rnd(T, Dm, dev=dev, dtype=act)
    rw, rb = _rnd(Em, Dm, dev=dev, scale=Dm**-0.5), _rnd(Em, dev=dev, scale=0.1)
    w, ids = moe_route.route_launch(x, rw, rb, k, 2, 1, True, 2.5)
    ref_w, ref_ids = moe_route.route_ref(_d(x), _d(rw), _d(rb), k, 2, 1, True, 2.5)
    o, ro = ids.long().sort(-1), ref_ids.sort(-1)
    w13, w2 = _rnd(Em, 2 * Im, Dm, dev=dev, dtype=act, scale=Dm**-0.5), _rnd(Em, Dm, Im, dev=dev, dtype=act, scale=Im**-0.5)
    s13, s2 = _rnd(2 * Im, Dm, dev=dev, dtype=act, scale=Dm**-0.5), _rnd(Dm, Im, dev=dev, dtype=act, scale=Im**-0.5)
    y = fused_moe.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2)
    ref = fused_moe.fused_moe_ref(_d(x), _d(w13), _d(w2), w.double(), ids.long(), 10.0, _d(s13), _d(s2))
    return [compare("hotpath.moe.route_ids", o.values, ro.values, atol=0, rtol=0),
            compare("hotpath.moe.route_weights", w.gather(1, o.indices), ref_w.gather(1, ro.indices), dtype="float32"),
            compare("hotpath.moe.experts", y, ref, dtype=act)]


def _paged(dev, lens, bs, width, dtype):
    W = max(-(-n // bs) for n in lens)
    nblocks = len(lens) * W + 1
    perm = torch.randperm(nblocks, device=dev)[: len(lens) * W].view(len(lens), W).to(torch.int32)
    return _rnd(nblocks, bs, width, dev=dev, dtype=dtype), perm


@_checked("hotpath.dsa_select")
def check_dsa(dev, act):
    from flashinfra.config import TextConfig
    from flashinfra.model.indexer import Indexer

    hi, di, bs, lens, q_lens = (HI, DI, 64, [700, 301], [1, 300]) if dev == "cuda" else (16, 16, 4, [37, 9], [1, 9])
    topk = 64 if dev == "cuda" else 8
    cache, tables = _paged(dev, lens, bs, 2 * di, torch.float32)
    T = sum(q_lens)
    q, w = _rnd(T, hi, di, dev=dev), _rnd(T, hi, dev=dev)
    ix = Indexer(TextConfig(index_n_heads=hi, index_head_dim=di, index_kpool=KPOOL, index_topk=topk,
                            hidden_size=32, q_lora_rank=16), torch.float32).to(dev)
    ix.pool_ape.copy_(_rnd(KPOOL, di, dev=dev))
    seq = torch.tensor([b for b, n in enumerate(q_lens) for _ in range(n)], dtype=torch.int32, device=dev)
    pos = torch.tensor([p for L, n in zip(lens, q_lens) for p in range(L - n, L)], dtype=torch.int32, device=dev)
    sel = dsa_indexer.dsa_select(cache, q, w, ix.pool_ape, tables, torch.tensor(lens, dtype=torch.int32, device=dev),
                                 seq, pos, KPOOL, topk, True)
    got = torch.zeros(T, max(lens), dtype=torch.int32)
    want = torch.zeros_like(got)
    at = 0
    for b, (L, n) in enumerate(zip(lens, q_lens)):
        entries = cache[tables[b].long()].flatten(0, 1)[:L]
        want[at:at + n, :L] = ix.select(entries, q[at:at + n], w[at:at + n]).int().cpu()
        at += n
    rows = torch.arange(T)[:, None].expand_as(sel).cpu()
    keep = sel.cpu() >= 0
    got[rows[keep], sel.cpu()[keep].long()] = 1
    return [compare("hotpath.dsa_select.positions", got, want, atol=0, rtol=0)]


@_checked("hotpath.sparse_mla")
def check_sparse_mla(dev, act):
    h, r, bs, lens, S = (H, R, 64, [3000, 67, 900], 2051) if dev == "cuda" else (4, 32, 4, [40, 9, 13], 11)
    latent, tables = _paged(dev, lens, bs, r, act)
    T = len(lens)
    q = _rnd(T, h, r, dev=dev, dtype=act)
    sel = torch.stack([torch.randint(-1, L, (S,), device=dev) for L in lens]).to(torch.int32)
    sel[:, 0] = torch.tensor(lens, device=dev) - 1  # every query sees at least itself
    seq = torch.arange(T, dtype=torch.int32, device=dev)
    out = sparse_mla.sparse_mla_launch(q, latent, sel, seq, tables, r**-0.5)
    ref = sparse_mla.sparse_mla_ref(_d(q), _d(latent), sel, seq, tables, r**-0.5)
    return [compare("hotpath.sparse_mla", out, ref, dtype=act)]


# ---- benchmarks -------------------------------------------------------------------------------------------


def _bench_dev(ctx: BenchContext) -> tuple[str, torch.dtype]:
    dev = "cuda" if ctx.device.startswith("cuda") else "cpu"
    return dev, (ctx.torch_dtype() if dev == "cuda" else torch.float32)


def _bench(name: str, fn):
    fn.__qualname__ = f"bench_{name}"
    register_benchmark(name, tags=TAGS)(fn)


def _fresh(seed: int, *shapes, dev, dtype):
    torch.manual_seed(seed)
    return tuple(_rnd(*shape, dev=dev, dtype=dtype) for shape in shapes)


def _norm_bench(T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        t, d = (min(T, 64), 256) if ctx.quick else (T, D)
        w = _rnd(d, dev=dev, dtype=act)
        es = act.itemsize
        return BenchSpec(fn=lambda x: norms.rms_norm_launch(x, w, 1e-5),
                         make_inputs=lambda seed: _fresh(seed, (t, d), dev=dev, dtype=act),
                         bytes=2 * t * d * es + d * es, flops=4 * t * d, description="fused RMSNorm",
                         params=dict(T=t, D=d))
    _bench(f"hotpath.rms_norm.t{T}", make)


def _mhc_bench(T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        t, d = (min(T, 64), 64) if ctx.quick else (T, D)
        nm = (2 + N_HC) * N_HC
        fn = _rnd(nm, N_HC * d, dev=dev, dtype=act, scale=(N_HC * d) ** -0.5)
        base, scale = _rnd(nm, dev=dev, scale=0.3), 1 + _rnd(3, dev=dev, scale=0.3)

        def step(x, out):
            y, post, comb = mhc.hc_pre_launch(x, fn, base, scale, N_HC, 20, 1e-6, 1e-5)
            return mhc.hc_post_launch(x, out + y, post, comb)

        es = act.itemsize
        return BenchSpec(fn=step, make_inputs=lambda seed: _fresh(seed, (t, N_HC, d), (t, d), dev=dev, dtype=act),
                         bytes=(2 * t * N_HC * d + 2 * t * d) * es + nm * N_HC * d * es,
                         flops=2 * t * N_HC * d * nm + 4 * t * N_HC * d * (N_HC + 1),
                         description="mHC pre (weights, Sinkhorn, collapse) + post (expand); block output added",
                         params=dict(T=t, D=d, n=N_HC))
    _bench(f"hotpath.mhc.t{T}", make)


def _moe_bench(T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        t, e, d, i, k = (min(T, 16), 8, 64, 32, 2) if ctx.quick else (T, E, D, I_MOE, TOPK)
        w13 = _rnd(e, 2 * i, d, dev=dev, dtype=act, scale=d**-0.5)
        w2 = _rnd(e, d, i, dev=dev, dtype=act, scale=i**-0.5)
        s13, s2 = _rnd(2 * i, d, dev=dev, dtype=act, scale=d**-0.5), _rnd(d, i, dev=dev, dtype=act, scale=i**-0.5)

        def inputs(seed):
            torch.manual_seed(seed)
            ids = torch.rand(t, e, device=dev).argsort(-1)[:, :k].to(torch.int32)
            return _rnd(t, d, dev=dev, dtype=act), torch.rand(t, k, device=dev), ids

        touched = e * (1 - (1 - k / e) ** t) + 1  # expected distinct experts under uniform routing, + shared
        es = act.itemsize
        return BenchSpec(fn=lambda x, w, ids: fused_moe.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2),
                         make_inputs=inputs, bytes=int(touched * 3 * i * d * es + 2 * t * d * es),
                         flops=2 * t * (k + 1) * 3 * i * d,
                         description="fused MoE: sorted dispatch, grouped GEMMs with clamped SwiGLU, shared expert",
                         params=dict(T=t, E=e, D=d, I=i, k=k, experts_touched=touched))
    _bench(f"hotpath.moe.t{T}", make)


def _select_inputs(dev, act, B, ctx_len, T, di, bs=64):
    W = -(-ctx_len // bs)
    cache = _rnd(B * W, bs, 2 * di, dev=dev, dtype=act)
    tables = torch.randperm(B * W, device=dev).view(B, W).to(torch.int32)
    per = T // B
    seq = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(per)
    pos = (torch.arange(ctx_len - per, ctx_len, dtype=torch.int32, device=dev)).repeat(B)
    return cache, tables, torch.full((B,), ctx_len, dtype=torch.int32, device=dev), seq, pos


def _dsa_bench(B: int, ctx_len: int, T: int):
    def make(ctx: BenchContext) -> BenchSpec:
        dev, act = _bench_dev(ctx)
        b, n, t, hi, di, topk = (min(B, 2), 64, min(B, 2), 16, 16, 16) if ctx.quick else (B, ctx_len, T, HI, DI, INDEX_TOPK)
        ape = _rnd(KPOOL, di, dev=dev, dtype=act)

        def inputs(seed):
            torch.manual_seed(seed)
            cache, tables, lens, seq, pos = _select_inputs(dev, act, b, n, t, di, bs=64 if not ctx.quick else 16)
            return cache, _rnd(t, hi, di, dev=dev, dtype=act), _rnd(t, hi, dev=dev), tables, lens, seq, pos

        P = n // KPOOL
        pairs = t * P if t == b else b * sum(min(P, (n - t // b + j + 1) // KPOOL) for j in range(t // b))
        return BenchSpec(fn=lambda c, q, w, tb, ln, s, p: dsa_indexer.dsa_select(c, q, w, ape, tb, ln, s, p, KPOOL,
                                                                                 topk, True),
                         make_inputs=inputs,
                         bytes=b * n * 2 * di * act.itemsize + 2 * b * P * di * act.itemsize + 2 * t * P * 8,
                         flops=2 * pairs * hi * di, description="DSA indexer: pool keys, scores, top-k, positions",
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
            latent = _rnd(b * W, bs, r, dev=dev, dtype=act)
            tables = torch.randperm(b * W, device=dev).view(b, W).to(torch.int32)
            per = t // b
            pos = torch.arange(n - per, n, device=dev).repeat(b)
            sel = (torch.rand(t, S, device=dev) * (pos[:, None] + 1)).long()  # anything the query can see
            return _rnd(t, h, r, dev=dev, dtype=act), latent, sel.to(torch.int32), \
                torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(per), tables

        rows = t * S
        return BenchSpec(fn=lambda q, lat, sel, seq, tb: sparse_mla.sparse_mla_launch(q, lat, sel, seq, tb, 256**-0.5),
                         make_inputs=inputs, bytes=min(rows, b * n) * r * act.itemsize + 2 * t * h * r * act.itemsize,
                         flops=4 * rows * h * r, description="absorbed sparse MLA over the paged latent",
                         params=dict(B=b, context=n, T=t, H=h, R=r, selected=S))
    _bench(f"hotpath.sparse_mla.b{B}.n{ctx_len}.t{T}", make)


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
