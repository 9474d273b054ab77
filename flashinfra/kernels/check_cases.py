"""Correctness cases of the hot-path kernels (norms, MoE routing and fused MoE, DSA indexer, sparse MLA, the
grammar's token bitmask), shared by the registered checks (checks.py, fixed sizes) and the tests
(``tests/kernels/interpret_hotpath.py`` and ``interpret_token_bitmask.py`` at the interpreter's small odd sizes,
``tests/kernels/test_hotpath_gpu.py`` at the GPU's real ones, through ``assert_passed``). The 8-bit caches' cases
are these with a cache format (``sparse_mla``, ``dsa_select``). mHC's cases are in ``mhc_cases.py``.

Each case (``norms``, ``route``, ``fused_moe``, ``moe_align``, ``dsa_select``, ``sparse_mla``,
``token_bitmask``, ``penalties``, ``graph_inputs``) takes the device, the sizes, the dtype and a seed; it draws
fresh random inputs, poisons the outputs with NaN where the launcher takes them, compares with the reference
computed in float64 (integer outputs: exactly) and returns ``list[CheckResult]``, failed ones included, instead of
raising.
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult, compare, poison_
from flashinfra.kernels import dsa_indexer, fused_moe as fm, moe_route, norms as nm, sparse_mla as sm
from flashinfra.kernels import penalties as pen
from flashinfra.kernels.graph_inputs import fill_chain_launch, fill_chain_ref, fill_step_launch, fill_step_ref
from flashinfra.kernels.dsa_pool_keys import write_pool_keys_launch
from flashinfra.kernels.moe_align import moe_align as align
from flashinfra.kernels.token_bitmask import apply_token_bitmask_launch, apply_token_bitmask_ref


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


def router_logits(device: str, T: int, E: int, D: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """The router's float32 logits of a few rows against float64."""
    gen = _gen(device, seed)
    x = rnd(T, D, device=device, gen=gen, dtype=dtype)
    weight = rnd(E, D, device=device, gen=gen, scale=D**-0.5)
    return [compare("hotpath.router_logits", moe_route.router_logits_launch(x, weight), _d(x) @ _d(weight).t(),
                    atol=2e-5, rtol=1e-4)]


def route(device: str, T: int, E: int, D: int, top_k: int, n_group: int, topk_group: int, dtype=torch.float32,
          seed=0) -> list[CheckResult]:
    """The same experts (as sets) with the same weights; the order within a token may differ."""
    gen = _gen(device, seed)
    x = rnd(T, D, device=device, gen=gen, dtype=dtype)
    weight, bias = rnd(E, D, device=device, gen=gen, scale=D**-0.5), rnd(E, device=device, gen=gen, scale=0.1)
    rw, rids = moe_route.route_ref(_d(x), _d(weight), _d(bias), top_k, n_group, topk_group, True, 2.5)
    rorder = rids.sort(-1)
    res = []
    # up to FMA_ROWS tokens also routed and aligned in one program (the MoE's block rows at decode)
    aligned = T <= moe_route.FMA_ROWS
    for name in ("route", "route_align") if aligned else ("route",):
        out = (moe_route.route_align_launch if name == "route_align" else moe_route.route_launch)(
            x, weight, bias, top_k, n_group, topk_group, True, 2.5)
        order = out[1].long().sort(-1)
        res += [compare(f"hotpath.{name}.ids", order.values, rorder.values, atol=0, rtol=0),
                compare(f"hotpath.{name}.weights", out[0].gather(1, order.indices), rw.gather(1, rorder.indices),
                        atol=1e-5, rtol=1e-4)]
        if name == "route_align":
            a = out[2]
            res += _alignment("hotpath.route_align", out[1], E, a.block_rows, a.sorted_ids, a.expert_ids, a.used)
    return res


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
    """Every pair (each token's ``top_k`` routed ones and its shared one, expert ``E``) appears once, each block
    holds pairs of one expert only, padding is the sentinel."""
    ids = torch.randint(0, E, (T, top_k), device=device, generator=_gen(device, seed))
    return _alignment("hotpath.moe_align", ids, E, BM, *align(ids, E, BM))


def _alignment(name: str, ids, E: int, BM: int, sorted_ids, expert_ids, used) -> list[CheckResult]:
    """``moe_align``'s properties of an alignment of the pairs of ``ids`` [T, top_k]."""
    T, top_k = ids.shape
    n, pairs = int(used), T * (top_k + 1)
    s = sorted_ids[:n].long().cpu()
    real = s[s < pairs]
    flat = torch.cat([ids.cpu(), torch.full((T, 1), E, dtype=ids.dtype)], 1).reshape(-1)  # each pair's expert
    want = sum(-(-int(c) // BM) * BM for c in torch.bincount(flat, minlength=E + 1))
    mixed = []
    for b in range(n // BM):
        blk = s[b * BM:(b + 1) * BM]
        blk = blk[blk < pairs]
        if not (blk.numel() and (flat[blk] == int(expert_ids[b])).all()):
            mixed.append(b)
    return [_verdict(f"{name}.pairs", sorted(real.tolist()) == list(range(pairs)),
                     f"{real.numel()} real entries for {pairs} pairs"),
            _verdict(f"{name}.blocks", not mixed,
                     f"{len(mixed)} of {n // BM} blocks empty or of several experts {mixed[:8] or ''}"),
            _verdict(f"{name}.padding", n % BM == 0 and n <= sorted_ids.numel(),
                     f"{n} entries used of {sorted_ids.numel()}, blocks of {BM}"),
            _verdict(f"{name}.used", n == want, f"{n} rows used, each expert's run padded to {BM}: {want}")]


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


def slots_of(tables: torch.Tensor, b: int, start: int, end: int, bs: int) -> torch.Tensor:
    """Flat cache slots of positions ``start .. end - 1`` of sequence ``b``."""
    pos = torch.arange(start, end, device=tables.device)
    return tables[b].long()[pos // bs] * bs + pos % bs


def select_over_entries(codes, scale, ape, q, w, tables, lens, token_seq, positions, kpool, topk):
    """``dsa_select`` over an entry cache already holding ``lens[b]`` entries per sequence: every complete pool's
    key written first (by the kernel, into a cache poisoned with NaN)."""
    bs = codes.shape[1]
    pool_keys = poison_(torch.empty(codes.shape[0], bs // kpool, ape.shape[1], dtype=q.dtype, device=q.device))
    slots = torch.cat([slots_of(tables, b, 0, n, bs) for b, n in enumerate(lens)])
    write_pool_keys_launch(codes, scale, ape, slots, pool_keys)
    return dsa_indexer.dsa_select(pool_keys, q, w, tables, token_seq, positions, kpool, topk, True)


def token_bitmask(device: str, N: int, V: int, R: int, vocab_size: int | None = None, dtype=torch.float32,
                  seed=0) -> list[CheckResult]:
    """The bitmask of ``R`` of ``N`` rows (drawn in shuffled order) applied in place to logits [N, V], bit for bit
    against the reference computed in float64: the rows left free, and the columns from ``vocab_size`` on, are
    poisoned with NaN and must come back unchanged; the bitmask rows past ``R`` (a buffer's unused rows) are 0s,
    which would mask every token if read."""
    vocab_size = V if vocab_size is None else vocab_size
    gen = _gen(device, seed)
    W = -(-vocab_size // 32)
    logits = rnd(N, V, device=device, gen=gen, dtype=dtype)
    rows = torch.randperm(N, device=device, generator=gen)[:R].to(torch.int32)
    free = torch.ones(N, dtype=torch.bool, device=device)
    free[rows.long()] = False
    logits[free] = float("nan")
    logits[:, vocab_size:] = float("nan")
    buf = torch.zeros(R + 2, W, dtype=torch.int32, device=device)
    buf[:R] = torch.randint(-2**31, 2**31 - 1, (R, W), dtype=torch.int32, device=device, generator=gen)
    ref64 = apply_token_bitmask_ref(_d(logits), buf[:R], rows, vocab_size)
    ref = ref64.to(dtype)
    ref[ref64.isnan()] = float("nan")  # the poison's own bits (a cast from float64 may give another NaN)
    out = apply_token_bitmask_launch(logits, buf[:R], rows, vocab_size)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    return [compare(f"hotpath.token_bitmask.n{N}.r{R}", out.view(bits), ref.view(bits), atol=0, rtol=0)]


def penalties(device: str, N: int, V: int, P: int, S: int, seed=0) -> list[CheckResult]:
    """``P`` of ``N`` rows (shuffled) penalized in place from ``P`` of ``S`` state rows (shuffled, counts mostly 0),
    against the reference in float64; the other rows are poisoned with NaN and must come back bit for bit."""
    gen = _gen(device, seed)
    x = rnd(N, V, device=device, gen=gen, scale=3.0)
    index = torch.randperm(N, device=device, generator=gen)[:P]
    rows = torch.randperm(S, device=device, generator=gen)[:P].to(torch.int32)
    counts = torch.randint(0, 4, (S, V), device=device, generator=gen, dtype=torch.int32)
    counts *= torch.rand(S, V, device=device, generator=gen) < 0.1
    prompt = torch.rand(S, V, device=device, generator=gen) < 0.05
    rep = 0.5 + 1.5 * torch.rand(P, 1, device=device, generator=gen)
    freq, pres = (torch.rand(P, 1, device=device, generator=gen) * 2 - 1 for _ in range(2))
    free = torch.ones(N, dtype=torch.bool, device=device)
    free[index] = False
    x[free] = float("nan")
    before = x.clone()
    ref = pen.penalize_ref(_d(x[index]), prompt[rows.long()], counts[rows.long()], _d(rep), _d(freq), _d(pres))
    out = pen.penalize_launch(x, index, rows, counts, prompt, rep, freq, pres)
    kept = torch.equal(out[free].view(torch.int32), before[free].view(torch.int32))
    return [compare(f"hotpath.penalties.n{N}.p{P}.v{V}", out[index], ref, atol=1e-5, rtol=1e-6),
            _verdict(f"hotpath.penalties.n{N}.p{P}.v{V}.others", kept, "rows without penalties left as they were")]


def graph_inputs(device: str, bs: int, q: int, B: int, w: int, W: int, seed=0) -> list[CheckResult]:
    """A step of ``B`` rows (1 to ``q`` tokens each, tables ``w`` wide) copied into a graph's ``bs`` rows of ``q``
    tokens (tables ``W`` wide), every destination poisoned first, against the tensor-op reference: equal exactly,
    and so is where each token went."""
    gen = _gen(device, seed)
    lens = torch.randint(1, q + 1, (B,), device=device, generator=gen)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), lens.cumsum(0).int()])
    T = int(cu[-1])

    def ints(n, dtype, hi=1 << 20, *shape):
        return torch.randint(0, hi, (n, *shape), device=device, generator=gen, dtype=dtype)

    src = (ints(T, torch.int64), cu, ints(T, torch.int64), ints(T, torch.int32), ints(B, torch.int64),
           ints(B, torch.int32, 1 << 20, w), ints(B, torch.int32))
    shapes = ((bs * q, torch.int64), (bs * q, torch.int64), (bs * q, torch.int32), (bs, torch.int64),
              ((bs, W), torch.int32), (bs, torch.int32), (bs * q, torch.int64))
    dst = tuple(torch.full(n if isinstance(n, tuple) else (n,), -7, dtype=dt, device=device) for n, dt in shapes)
    ref = tuple(t.clone() for t in dst)
    scratch = (12345, 77, 99)
    fill_step_launch(src, dst, q, scratch)
    fill_step_ref(src, ref, q, scratch)
    names = ("input_ids", "slot_mapping", "positions", "state_slots", "block_tables", "seq_lens")
    tag = f"hotpath.graph_inputs.bs{bs}.q{q}.b{B}.w{w}"
    out = [compare(f"{tag}.{n}", o, r, atol=0, rtol=0) for n, o, r in zip(names, dst, ref)]
    out.append(compare(f"{tag}.at", dst[6][:T], ref[6][:T], atol=0, rtol=0))
    # the chain of q - 1 steps over the same rows: next positions around their tables' ends (some past them)
    caps = ((src[5][:, 0] % w + 1) * 16).contiguous() if w else torch.zeros(B, dtype=torch.int32, device=device)
    tables = (src[5] % 1000).contiguous()
    nxt = (caps.long() - torch.randint(-2, 2 * q, (B,), device=device, generator=gen)).clamp(min=0)
    chain = (torch.full((bs, W), -7, dtype=torch.int32, device=device), torch.full((q - 1, bs), -7, device=device),
             *(torch.full((q - 1, bs), -7, dtype=torch.int32, device=device) for _ in range(2)))
    chain_ref = tuple(t.clone() for t in chain)
    fill_chain_launch((nxt, caps, tables), chain, 16, (12345, 99))
    fill_chain_ref((nxt, caps, tables), chain_ref, 16, (12345, 99))
    names = ("block_tables", "slot_mapping", "positions", "seq_lens")
    return out + [compare(f"{tag}.chain.{n}", o, r, atol=0, rtol=0) for n, o, r in zip(names, chain, chain_ref)]
