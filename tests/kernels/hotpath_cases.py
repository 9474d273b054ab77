"""Test cases of the hot-path kernels (norms, mHC, MoE, DSA indexer, sparse MLA), shared by the interpreter
tests (CPU, small sizes) and the GPU tests (real sizes). Every case draws fresh random inputs, poisons the
outputs with NaN where the launcher takes them, and compares with the reference computed in float64."""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import compare

NAN = float("nan")


def rnd(*shape, device, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)


def tol(dtype) -> dict:
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def check(name, out, ref, **kw):
    r = compare(name, out, ref, **kw)
    assert r.passed, r.summary()


def _d(t):
    return t.double() if t.is_floating_point() else t


def norms(device: str, T: int, D: int, dtype=torch.float32, seed=0):
    from flashinfra.kernels import norms as nm

    gen = torch.Generator(device=device).manual_seed(seed)
    x, w = rnd(T, D, device=device, gen=gen, dtype=dtype), rnd(D, device=device, gen=gen, dtype=dtype)
    g = rnd(T, D, device=device, gen=gen, dtype=dtype)
    out = torch.full_like(x, NAN)
    nm.rms_norm_launch(x, w, 1e-5, out=out)
    check("rms_norm", out, nm.rms_norm_ref(_d(x), _d(w), 1e-5), **tol(dtype))
    if dtype != torch.float32:
        # rounds where the reference rounds (the normalised row, then the product): the float32 sums differ
        # in order, so a normalised value can round one unit the other way, and its product two at most
        ulps = (out.view(torch.int16).int() - nm.rms_norm_ref(x, w, 1e-5).view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 2, f"rms_norm is {int(ulps.max())} ulps from its reference's rounding"
    out = torch.full_like(x, NAN)
    nm.gated_rms_norm_launch(x, g, w, 1e-5, out=out)
    check("gated_rms_norm", out, nm.gated_rms_norm_ref(_d(x), _d(g), _d(w), 1e-5), **tol(dtype))


def hc_params(n: int, D: int, device, gen, dtype):
    fn = rnd((2 + n) * n, n * D, device=device, gen=gen, dtype=dtype, scale=(n * D) ** -0.5)
    base = rnd((2 + n) * n, device=device, gen=gen, scale=0.3)
    scale = 1 + rnd(3, device=device, gen=gen, scale=0.3)
    return fn, base, scale


def mhc(device: str, T: int, D: int, n: int = 4, dtype=torch.float32, seed=0):
    from flashinfra.kernels import mhc as hc

    gen = torch.Generator(device=device).manual_seed(seed)
    streams = rnd(T, n, D, device=device, gen=gen, dtype=dtype)
    fn, base, scale = hc_params(n, D, device, gen, dtype)
    y, post, comb = hc.hc_pre_launch(streams, fn, base, scale, n, 20, 1e-6, 1e-5)
    ry, rpost, rcomb = hc.hc_pre_ref(_d(streams), _d(fn), _d(base), _d(scale), n, 20, 1e-6, 1e-5)
    wtol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    check("hc_pre.post", post, rpost, **wtol)
    check("hc_pre.comb", comb, rcomb, **wtol)
    check("hc_pre.collapsed", y, ry, **tol(dtype))
    out = rnd(T, D, device=device, gen=gen, dtype=dtype)
    new = hc.hc_post_launch(streams, out, post, comb)
    check("hc_post", new, hc.hc_post_ref(_d(streams), _d(out), rpost, rcomb), **tol(dtype))


def route(device: str, T: int, E: int, D: int, top_k: int, n_group: int, topk_group: int, seed=0):
    from flashinfra.kernels import moe_route as mr

    gen = torch.Generator(device=device).manual_seed(seed)
    x = rnd(T, D, device=device, gen=gen)
    weight, bias = rnd(E, D, device=device, gen=gen, scale=D**-0.5), rnd(E, device=device, gen=gen, scale=0.1)
    w, ids = mr.route_launch(x, weight, bias, top_k, n_group, topk_group, True, 2.5)
    rw, rids = mr.route_ref(_d(x), _d(weight), _d(bias), top_k, n_group, topk_group, True, 2.5)
    # the same experts (as sets) with the same weights; the order within a token may differ
    order, rorder = ids.long().sort(-1), rids.sort(-1)
    assert torch.equal(order.values, rorder.values), "route: different experts chosen"
    check("route.weights", w.gather(1, order.indices), rw.gather(1, rorder.indices), atol=1e-5, rtol=1e-4)


def fused_moe(device: str, T: int, E: int, D: int, I: int, top_k: int, dtype=torch.float32, seed=0, limit=1.0,
              shared_mult: int = 1):
    """Random routing (with repeats of experts across tokens, some experts unused) against the float64 loop."""
    from flashinfra.kernels import fused_moe as fm

    gen = torch.Generator(device=device).manual_seed(seed)
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
    check("fused_moe", out, ref, **tol(dtype))
    return out


def moe_align(device: str, T: int, E: int, top_k: int, BM: int, seed=0):
    """Every pair appears once, each block holds pairs of one expert only, padding is the sentinel."""
    from flashinfra.kernels.fused_moe import moe_align as align

    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(0, E, (T, top_k), device=device, generator=gen)
    sorted_ids, expert_ids, used = align(ids, E, BM)
    n = int(used)
    s = sorted_ids[:n].long().cpu()
    real = s[s < T * top_k]
    assert sorted(real.tolist()) == list(range(T * top_k))
    flat = ids.reshape(-1).cpu()
    for b in range(n // BM):
        blk = s[b * BM:(b + 1) * BM]
        blk = blk[blk < T * top_k]
        assert blk.numel() and (flat[blk] == int(expert_ids[b])).all()
    assert n % BM == 0 and n <= sorted_ids.numel()


def _paged(device, gen, lens: list[int], bs: int, width: int, dtype):
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


def _gather(cache, table, n):
    return cache[table.long()].flatten(0, 1)[:n]


def dsa_select(device: str, ctx: list[int], qlens: list[int], Hi=16, Di=16, kpool=4, topk=8, bs=4,
               ties=False, dtype=torch.float32, seed=0):
    """dsa_select's positions equal the set the model's ``Indexer.select`` marks, query by query."""
    from flashinfra.config import TextConfig
    from flashinfra.kernels.dsa_indexer import dsa_select as select
    from flashinfra.model.indexer import Indexer

    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [c + q for c, q in zip(ctx, qlens)]
    cache, tables = _paged(device, gen, lens, bs, 2 * Di, dtype)
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
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    sel = select(cache, q, w, ix.pool_ape, tables, seq_lens, token_seq, positions, kpool, topk, True)
    at, near_ties = 0, 0
    for b, (c, n) in enumerate(zip(ctx, qlens)):
        entries = _gather(cache, tables[b], lens[b])
        mask = ix.select(entries, q[at:at + n], w[at:at + n])
        for i in range(n):
            got = sorted(p for p in sel[at + i].tolist() if p >= 0)
            want = torch.nonzero(mask[i]).flatten().tolist()
            if got != want:
                near_ties += 1
                _only_near_ties(got, want, entries, q[at + i], w[at + i], ix, c + i, topk, kpool)
        at += n
    assert near_ties <= max(1, T // 50), f"{near_ties} of {T} queries differ (all at near-ties)"
    return sel


def _only_near_ties(got, want, entries, q, w, ix, pos, topk, kpool):
    """A selection may differ from the reference only by pools whose float64 scores tie (to rounding) with
    the last pool selected; the tail must be the same."""
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
        assert p < P * kpool, f"query at {pos}: tail positions differ: {sorted(diff)}"
        gap = float((score[p // kpool] - kth).abs())
        assert gap <= 1e-5 * float(score.abs().max()) + 1e-30, f"query at {pos}: pool {p // kpool} differs, gap {gap}"


def sparse_mla(device: str, ctx: list[int], qlens: list[int], H=4, R=32, bs=4, S=11, split=None,
               dtype=torch.float32, seed=0):
    from flashinfra.kernels import sparse_mla as sm

    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [c + q for c, q in zip(ctx, qlens)]
    latent, tables = _paged(device, gen, lens, bs, R, dtype)
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
    out = sm.sparse_mla_launch(q, latent, sel, token_seq, tables, R**-0.5, split=split)
    ref = sm.sparse_mla_ref(_d(q), _d(latent), sel, token_seq, tables, R**-0.5)
    check("sparse_mla", out, ref, **tol(dtype))


def batched_greedy(model, prompts: list[list[int]], steps: int, bs: int = 16, feed=None):
    """Packed prefill of all prompts, then ``steps - 1`` decode steps of the whole batch; per step the tokens
    and logits. ``feed`` (tokens per step) replaces the argmax as the next input (teacher forcing)."""
    from flashinfra.model.forward_batch import ForwardBatch

    dev = model.device
    need = [-(-(len(p) + steps) // bs) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1])))[::-1] for i in range(len(prompts))]
    cache = model.allocate_cache(sum(need), bs, len(prompts) + 1)
    slots = list(range(len(prompts), 0, -1))
    batch = ForwardBatch.build([len(p) for p in prompts], [0] * len(prompts), slots, tables, bs, dev)
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    hidden = model.forward(ids, batch, cache)
    logits = [model.compute_logits(hidden[torch.tensor(batch.last_token_indices, device=dev)])]
    tokens = [logits[-1].argmax(-1).tolist()]
    for i in range(steps - 1):
        batch = ForwardBatch.build([1] * len(prompts), [len(p) + i for p in prompts], slots, tables, bs, dev)
        nxt = tokens[-1] if feed is None else feed[i]
        logits.append(model.compute_logits(model.forward(torch.tensor(nxt, device=dev), batch, cache)))
        tokens.append(logits[-1].argmax(-1).tolist())
    return tokens, logits


TEXTS = ("In the beginning God created the heaven and the earth. And the earth was without form",
         "def main():", "The Python tutorial: an informal introduction to Python. In the following examples, "
         "input and output are distinguished by the presence or absence of prompts")


def tiny_model_batched_greedy_same(tmp_path, monkeypatch, device: str, dtype="float32", steps: int = 6,
                                   trained: bool = False):
    """The small random checkpoint, or the trained default model (``trained``: its predictions are decided
    by margins a rounding difference cannot flip, where a random model's often are not).
    float32: the same greedy tokens with the kernels and the references. bf16 (where rounding differs):
    with the reference's tokens fed to both, every step's logits agree to bf16 accuracy and the argmax
    agrees wherever the reference's top-2 margin exceeds twice the logits' difference."""
    from flashinfra.kernels import dispatch
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    if trained:
        from tokenizers import Tokenizer

        from flashinfra.model.factory import default_model_dir

        model = load_model(default_model_dir(), dtype=dtype, device=device)
        tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
        prompts = [tok.encode(text).ids for text in TEXTS]
    else:
        model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=2), dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    assert dispatch.use_triton(torch.empty(0, device=device)), "the kernels' path is not active"
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    ref, ref_logits = batched_greedy(model, prompts, steps)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: False)
    if dtype == "float32":
        fast, fast_logits = batched_greedy(model, prompts, steps)
        assert fast == ref
        for a, b in zip(fast_logits, ref_logits):  # the KDA chunk kernels' in-chunk products run in tf32
            assert float((a - b).norm() / b.norm()) < 2e-3
        return
    fast, fast_logits = batched_greedy(model, prompts, steps, feed=ref[:-1])
    for step, (a, b) in enumerate(zip(fast_logits, ref_logits)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 3e-2, f"step {step}"
        diff = float((a.float() - b.float()).abs().max())
        top2 = b.float().topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert torch.equal(a.argmax(-1)[decided], b.argmax(-1)[decided]), f"step {step}"



def layerwise(device: str, dtype: str, hi_dtype: torch.dtype, factor: float, floor: float, lengths=(37, 5, 20)):
    """Every layer of the small random checkpoint, fed the reference's input, is no further from the
    reference run in ``hi_dtype`` with the kernels than with the references (``model.layerwise``)."""
    import tempfile

    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.model.layerwise import compare_layers

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny_checkpoint(f"{tmp}/tiny", seed=2), dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lengths]
    errors = compare_layers(model, prompts, hi_dtype)
    assert len(errors) == 2 * (len(model.model.layers) + 1)
    bad = [e for e in errors if not e.within(factor, floor)]
    assert not bad, "\n".join(map(str, bad))
    return errors
