"""Checks and benchmarks of the hot-path kernels (norms, mHC, MoE routing and fused MoE, DSA indexer,
sparse MLA), registered with ``flashinfra.feedback``.

The cases (``norms``, ``mhc``, ``route``, ``fused_moe``, ``moe_align``, ``dsa_select``, ``sparse_mla``) take
the device, the sizes, the dtype and a seed; each draws fresh random inputs, poisons the outputs with NaN
where the launcher takes them, compares with the reference computed in float64 and returns
``list[CheckResult]``. The registered checks (``flashinfra check hotpath``) run them at fixed sizes: on CUDA
in bf16 when there is one, else in float32 under Triton's CPU interpreter in a child process. The tests
(``tests/kernels/test_hotpath_*.py``) run the same cases at their own sizes and ``assert_passed`` the results.
Benchmarks (``flashinfra bench hotpath``) time the launchers at GLM-5.3-Flash sizes (``quick``: small), with
the bytes each must move and the FLOPs it must do, for the roofline fractions.
"""

from __future__ import annotations

import random

import torch

from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, compare, poison_, \
    register_benchmark, register_check
from flashinfra.kernels import dsa_indexer, dsa_pool_keys, fused_moe as fm, mhc as hc, moe_route, norms as nm, \
    sparse_mla as sm
from flashinfra.kernels.interpreted import kernel_device, run_in_interpreter

TAGS = ("kernel", "hotpath", "triton")
# GLM-5.3-Flash sizes
D, N_HC, E, TOPK, I_MOE = 4096, 4, 288, 8, 2048
H, R, HI, DI, KPOOL, INDEX_TOPK = 64, 512, 32, 128, 4, 2048


def rnd(*shape, device, gen=None, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)


def tol(dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def _d(t):
    return t.double() if t.is_floating_point() else t


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def _verdict(name: str, ok: bool, message: str) -> CheckResult:
    """A result of a check that is a property, not an element-wise comparison."""
    return CheckResult(name=name, passed=bool(ok), message=message)


# ---- cases --------------------------------------------------------------------------------------------


def norms(device: str, T: int, D: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    x, w = rnd(T, D, device=device, gen=gen, dtype=dtype), rnd(D, device=device, gen=gen, dtype=dtype)
    g = rnd(T, D, device=device, gen=gen, dtype=dtype)
    out = poison_(torch.empty_like(x))
    nm.rms_norm_launch(x, w, 1e-5, out=out)
    results = [compare("hotpath.norms.rms", out, nm.rms_norm_ref(_d(x), _d(w), 1e-5), **tol(dtype))]
    if dtype != torch.float32:
        # rounds where the reference rounds (the normalised row, then the product): the float32 sums differ
        # in order, so a normalised value can round one unit the other way, and its product two at most
        ulps = (out.view(torch.int16).int() - nm.rms_norm_ref(x, w, 1e-5).view(torch.int16).int()).abs()
        results.append(compare("hotpath.norms.rms_ulps", ulps, torch.zeros_like(ulps), atol=2, rtol=0))
    gout = poison_(torch.empty_like(x))
    nm.gated_rms_norm_launch(x, g, w, 1e-5, out=gout)
    results.append(compare("hotpath.norms.gated", gout, nm.gated_rms_norm_ref(_d(x), _d(g), _d(w), 1e-5),
                           **tol(dtype)))
    return results


def mhc(device: str, T: int, D: int, n: int = 4, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    streams = rnd(T, n, D, device=device, gen=gen, dtype=dtype)
    fn = rnd((2 + n) * n, n * D, device=device, gen=gen, dtype=dtype, scale=(n * D) ** -0.5)
    base = rnd((2 + n) * n, device=device, gen=gen, scale=0.3)
    scale = 1 + rnd(3, device=device, gen=gen, scale=0.3)
    y, post, comb = hc.hc_pre_launch(streams, fn, base, scale, n, 20, 1e-6, 1e-5)
    ry, rpost, rcomb = hc.hc_pre_ref(_d(streams), _d(fn), _d(base), _d(scale), n, 20, 1e-6, 1e-5)
    wtol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    out = rnd(T, D, device=device, gen=gen, dtype=dtype)
    new = hc.hc_post_launch(streams, out, post, comb)
    return [compare("hotpath.mhc.post_weights", post, rpost, **wtol),
            compare("hotpath.mhc.comb", comb, rcomb, **wtol),
            compare("hotpath.mhc.collapsed", y, ry, **tol(dtype)),
            compare("hotpath.mhc.expand", new, hc.hc_post_ref(_d(streams), _d(out), rpost, rcomb), **tol(dtype))]


def route(device: str, T: int, E: int, D: int, top_k: int, n_group: int, topk_group: int, dtype=torch.float32,
          seed=0) -> list[CheckResult]:
    """The same experts (as sets) with the same weights; the order within a token may differ."""
    gen = _gen(device, seed)
    x = rnd(T, D, device=device, gen=gen, dtype=dtype)
    weight, bias = rnd(E, D, device=device, gen=gen, scale=D**-0.5), rnd(E, device=device, gen=gen, scale=0.1)
    w, ids = moe_route.route_launch(x, weight, bias, top_k, n_group, topk_group, True, 2.5)
    rw, rids = moe_route.route_ref(_d(x), _d(weight), _d(bias), top_k, n_group, topk_group, True, 2.5)
    order, rorder = ids.long().sort(-1), rids.sort(-1)
    return [compare("hotpath.route.ids", order.values, rorder.values, atol=0, rtol=0),
            compare("hotpath.route.weights", w.gather(1, order.indices), rw.gather(1, rorder.indices),
                    atol=1e-5, rtol=1e-4)]


def fused_moe(device: str, T: int, E: int, D: int, I: int, top_k: int, dtype=torch.float32, seed=0, limit=1.0,
              shared_mult: int = 1) -> list[CheckResult]:
    """Random routing (with repeats of experts across tokens, some experts unused) against the float64 loop."""
    gen = _gen(device, seed)
    x = rnd(T, D, device=device, gen=gen, dtype=dtype)
    w13 = rnd(E, 2 * I, D, device=device, gen=gen, dtype=dtype, scale=D**-0.5)
    w2 = rnd(E, D, I, device=device, gen=gen, dtype=dtype, scale=I**-0.5)
    Is = I * shared_mult
    sw13 = rnd(2 * Is, D, device=device, gen=gen, dtype=dtype, scale=D**-0.5)
    sw2 = rnd(D, Is, device=device, gen=gen, dtype=dtype, scale=Is**-0.5)
    ids = torch.stack([torch.randperm(E, device=device, generator=gen)[:top_k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, top_k, device=device, generator=gen)
    out = fm.fused_moe_launch(x, w13, w2, w, ids, limit, sw13, sw2)
    ref = fm.fused_moe_ref(_d(x), _d(w13), _d(w2), w.double(), ids.long(), limit, _d(sw13), _d(sw2))
    return [compare("hotpath.fused_moe", out, ref, **tol(dtype))]


def moe_align(device: str, T: int, E: int, top_k: int, BM: int, seed=0) -> list[CheckResult]:
    """Every pair appears once, each block holds pairs of one expert only, padding is the sentinel."""
    ids = torch.randint(0, E, (T, top_k), device=device, generator=_gen(device, seed))
    sorted_ids, expert_ids, used = fm.moe_align(ids, E, BM)
    n = int(used)
    s = sorted_ids[:n].long().cpu()
    real = s[s < T * top_k]
    flat = ids.reshape(-1).cpu()
    mixed = []
    for b in range(n // BM):
        blk = s[b * BM:(b + 1) * BM]
        blk = blk[blk < T * top_k]
        if not (blk.numel() and (flat[blk] == int(expert_ids[b])).all()):
            mixed.append(b)
    return [_verdict("hotpath.moe_align.pairs", sorted(real.tolist()) == list(range(T * top_k)),
                     f"{real.numel()} real entries for {T * top_k} pairs"),
            _verdict("hotpath.moe_align.blocks", not mixed,
                     f"{len(mixed)} of {n // BM} blocks empty or of several experts {mixed[:8] or ''}"),
            _verdict("hotpath.moe_align.padding", n % BM == 0 and n <= sorted_ids.numel(),
                     f"{n} entries used of {sorted_ids.numel()}, blocks of {BM}")]


def paged_cache(device, gen, lens: list[int], bs: int, width: int, dtype):
    """A paged cache holding ``lens[b]`` random entries per sequence in shuffled blocks."""
    need = [-(-n // bs) for n in lens]
    W = max(need)
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(len(lens))).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n] + [0] * (W - n))
        at += n
    cache = rnd(sum(need) + 3, bs, width, device=device, gen=gen, dtype=dtype)
    return cache, torch.tensor(tables, dtype=torch.int32, device=device)


def quantized_cache(cache: torch.Tensor, fmt: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cache`` [blocks, bs, W] in 8 bits as ``flashinfra.quant.cache`` writes it: int8 with one scale per entry, or
    e4m3 with one per ``group`` channels -> (codes, float32 scales [blocks, bs, W / group], the dequantized cache in
    cache's dtype, which is what the references read)."""
    from flashinfra.kernels.quant.act import quant_act_ref

    blocks, bs, width = cache.shape
    codes, scale = quant_act_ref(fmt, cache.reshape(-1, width), group)
    scale = scale.reshape(blocks, bs, -1).contiguous()
    deq = codes.double().view(blocks, bs, scale.shape[-1], -1) * scale.double()[..., None]
    return codes.view(cache.shape), scale, deq.view(cache.shape).to(cache.dtype)


def dsa_select(device: str, ctx: list[int], qlens: list[int], Hi=16, Di=16, kpool=4, topk=8, bs=4,
               ties=False, fp8=False, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """dsa_select's positions equal the set the model's ``Indexer.select`` marks, query by query, but for
    a few queries (at most one in 50) that differ only at near-ties. With ``fp8`` the kernel reads an e4m3 cache
    (a scale per entry for the key and one for the gate score) and the reference the dequantized entries."""
    from flashinfra.config import TextConfig
    from flashinfra.model.indexer import Indexer

    gen = _gen(device, seed)
    lens = [c + q for c, q in zip(ctx, qlens)]
    cache, tables = paged_cache(device, gen, lens, bs, 2 * Di, dtype)
    T = sum(qlens)
    q = rnd(T, Hi, Di, device=device, gen=gen, dtype=dtype)
    w = rnd(T, Hi, device=device, gen=gen)
    if ties:  # every q.k negative: every pool scores exactly 0, selection is decided by the tie rule alone
        q, w = -q.abs(), w.abs()
        cache[..., :Di] = cache[..., :Di].abs()
    cfg = TextConfig(index_n_heads=Hi, index_head_dim=Di, index_kpool=kpool, index_topk=topk, hidden_size=32,
                     q_lora_rank=16)
    ix = Indexer(cfg, dtype).to(device)
    ix.pool_ape.copy_(rnd(kpool, Di, device=device, gen=gen, dtype=dtype))
    token_seq = torch.tensor([b for b, n in enumerate(qlens) for _ in range(n)], dtype=torch.int32, device=device)
    positions = torch.tensor([p for c, n in zip(ctx, qlens) for p in range(c, c + n)], dtype=torch.int32,
                             device=device)
    codes, scale = cache, None
    if fp8:
        codes, scale, cache = quantized_cache(cache, "fp8", Di)
    from flashinfra.kernels.dsa_indexer_cases import select_over_entries

    sel = select_over_entries(codes, scale, ix.pool_ape, q, w, tables, lens, token_seq, positions, kpool, topk)
    at, differ, unexplained = 0, 0, []
    for b, (c, n) in enumerate(zip(ctx, qlens)):
        entries = cache[tables[b].long()].flatten(0, 1)[:lens[b]]
        mask = ix.select(entries, q[at:at + n], w[at:at + n])
        for i in range(n):
            got = sorted(p for p in sel[at + i].tolist() if p >= 0)
            want = torch.nonzero(mask[i]).flatten().tolist()
            if got != want:
                differ += 1
                why = _not_near_tie(got, want, entries, q[at + i], w[at + i], ix, c + i, topk, kpool)
                if why:
                    unexplained.append(why)
        at += n
    allowed = max(1, T // 50)
    message = f"{differ} of {T} queries differ from Indexer.select (allowed {allowed}, at near-ties only)"
    name = "dsa_select.fp8_cache.positions" if fp8 else "hotpath.dsa_select.positions"
    return [_verdict(name, differ <= allowed and not unexplained,
                     "; ".join([message, *unexplained[:4]]))]


def _not_near_tie(got, want, entries, q, w, ix, pos, topk, kpool) -> str | None:
    """Why a selection differs from the reference other than by pools whose float64 scores tie (to rounding)
    with the last pool selected, with the same tail; None when it does not."""
    N = entries.shape[0]
    P = N // kpool
    keys, gates = entries[: P * kpool].double().view(P, kpool, -1).chunk(2, dim=-1)
    probs = torch.softmax(gates + ix.pool_ape.double()[None], dim=1)
    scores = torch.relu(q.double() @ (probs * keys).sum(1).t() * q.shape[-1] ** -0.5)  # [Hi, P]
    score = w.double() @ scores  # [P]
    visible = torch.arange(P, device=score.device) * kpool + kpool - 1 <= pos
    vis_scores = score[visible]
    kth = vis_scores.sort(descending=True).values[min(topk // kpool, vis_scores.numel()) - 1]
    diff = set(got) ^ set(want)
    for p in diff:
        if p >= P * kpool:
            return f"query at {pos}: tail positions differ: {sorted(diff)}"
        gap = float((score[p // kpool] - kth).abs())
        if gap > 1e-5 * float(score.abs().max()) + 1e-30:
            return f"query at {pos}: pool {p // kpool} differs, gap {gap}"
    return None


# the 8-bit latent caches' error budgets: attention against the unquantized latent (relative Frobenius error)
CACHE_REL = {"int8": 0.02, "fp8": 0.08}


def sparse_mla(device: str, ctx: list[int], qlens: list[int], H=4, R=32, bs=4, S=11, split=None, cache="float",
               dtype=torch.float32, seed=0) -> list[CheckResult]:
    """Against the float64 reference; with ``cache`` "int8" / "fp8" the latent is quantized per entry as the cache
    writes it, and the kernel is checked against the reference on the same codes and, within ``CACHE_REL``,
    against attention over the unquantized latent."""
    gen = _gen(device, seed)
    lens = [c + q for c, q in zip(ctx, qlens)]
    latent, tables = paged_cache(device, gen, lens, bs, R, dtype)
    T = sum(qlens)
    q = rnd(T, H, R, device=device, gen=gen, dtype=dtype)
    token_seq = torch.tensor([b for b, n in enumerate(qlens) for _ in range(n)], dtype=torch.int32, device=device)
    rows = []
    for c, n in zip(ctx, qlens):
        for p in range(c, c + n):
            pick = torch.randperm(p + 1, generator=torch.Generator().manual_seed(p))[:S].tolist()
            pick = pick + [-1] * (S - len(pick))
            rows.append([pick[i] for i in torch.randperm(S, generator=torch.Generator().manual_seed(7 + p))])
    sel = torch.tensor(rows, dtype=torch.int32, device=device)
    if cache == "float":
        out = sm.sparse_mla_launch(q, latent, sel, token_seq, tables, R**-0.5, split=split)
        ref = sm.sparse_mla_ref(_d(q), _d(latent), sel, token_seq, tables, R**-0.5)
        return [compare("hotpath.sparse_mla", out, ref, **tol(dtype))]
    codes, scale, _ = quantized_cache(latent, cache, 1 << (R - 1).bit_length())  # fp8: one group spans the row
    scale = scale[..., 0]
    out = sm.sparse_mla_launch(q, codes, sel, token_seq, tables, R**-0.5, scale, split=split)
    ref = sm.sparse_mla_ref(_d(q), codes, sel, token_seq, tables, R**-0.5, scale)
    full = sm.sparse_mla_ref(_d(q), _d(latent), sel, token_seq, tables, R**-0.5)
    err = float((out.double() - full).norm() / full.norm())
    return [compare(f"sparse_mla.{cache}_cache", out, ref, **tol(dtype)),
            _verdict(f"sparse_mla.{cache}_cache_error", err < CACHE_REL[cache],
                     f"{err:.4f} from attention over the unquantized latent (bound {CACHE_REL[cache]:g})")]


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


@_registered("hotpath.sparse_mla")
def _sparse_mla(dev, act, seed):
    if dev == "cuda":
        return sparse_mla(dev, [2999, 66, 899], [1, 1, 1], H=H, R=R, bs=64, S=2051, dtype=act, seed=seed)
    return sparse_mla(dev, [39, 8, 12], [1, 1, 1], seed=seed)


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
            return hc.hc_post_launch(x, out + y, post, comb)

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
        return BenchSpec(fn=step, make_inputs=inputs,
                         bytes=b * P * di * es + t * (2 * di + di // KPOOL) * es + 2 * t * P * 8,
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
