"""Sweep of index_score_kernel tiles against the previous kernel: T queries x P pools of one sequence."""
import importlib.util, json, sys, os
import torch, triton
from flashinfra.kernels import dsa_indexer as new
spec = importlib.util.spec_from_file_location("dsa_old", "bench/dsa_indexer_before.py")
old = importlib.util.module_from_spec(spec); sys.modules["dsa_old"] = old; spec.loader.exec_module(old)

def ev_time(fn, iters=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(3):
        a.record()
        for _ in range(iters): fn()
        b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / iters * 1e3)
    return min(ts)

import triton.language as tl

@triton.jit
def score_n(q, w, pool_keys, block_tables, out, T, W, P, scale, KP: tl.constexpr, BS: tl.constexpr, HI: tl.constexpr,
            DI: tl.constexpr, QN: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr):
    """One sequence, every pool visible: QN queries' heads as the product's columns, summed per query."""
    i_t, i_p = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < P
    o_d = tl.arange(0, DI)
    blk = tl.load(block_tables + o_p * KP // BS, mask=m_p, other=0).to(tl.int64)
    row = blk * (BS // KP) + o_p % (BS // KP)
    b_k = tl.load(pool_keys + row[:, None] * DI + o_d[None, :], mask=m_p[:, None], other=0.0)
    o_c = tl.arange(0, QN * HI)
    for i in range(0, BT // QN):
        t = (i_t * BT + i * QN + o_c // HI).to(tl.int64)
        b_q = tl.load(q + t[:, None] * (HI * DI) + (o_c % HI)[:, None] * DI + o_d[None, :])
        s = tl.dot(b_k, tl.trans(b_q))
        b_w = tl.load(w + t * HI + o_c % HI)
        s = b_w[None, :] * tl.maximum(s * scale, 0.0)
        score = tl.sum(tl.reshape(s, (BP, QN, HI)), 2)
        score = tl.where(score == 0.0, 0.0, score)
        bits = score.to(tl.int32, bitcast=True)
        bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        tq = i_t * BT + i * QN + tl.arange(0, QN)
        tl.store(out + tq.to(tl.int64)[None, :] * P + o_p[:, None], bits, mask=m_p[:, None])

res = []
Hi, Di, kp, bs = 32, 128, 4, 64
for T, ctx in ((256, 1048576), (1, 1048576)):
    P = ctx // kp
    blocks = ctx // bs + 1
    pk = torch.randn(blocks, bs // kp, Di, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
    q = torch.randn(T, Hi, Di, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(T, Hi, device="cuda")
    ts = torch.zeros(T, device="cuda", dtype=torch.int32)
    pos = torch.arange(ctx - T, ctx, device="cuda", dtype=torch.int32)
    out_old = torch.empty(T, P, device="cuda", dtype=torch.int32); out = torch.empty_like(out_old)
    t_old = ev_time(lambda: old.scores_launch(pk, q, w, tables, ts, pos, kp, out_old))
    flops = 2 * T * P * Hi * Di
    row = dict(T=T, P=P, old_us=t_old, old_tflops=flops / t_old / 1e6, configs=[])
    for BT, BP, nw in ((16, 128, 4), (16, 128, 8), (32, 128, 4), (16, 256, 8)):
        if T == 1 and BT > 16: continue
        new.SCORE_QUERIES, new.SCORE_POOLS, new.SCORE_WARPS = BT, BP, nw
        try:
            t = ev_time(lambda: new.scores_launch(pk, q, w, tables, ts, pos, kp, out))
            same = bool((out == out_old).float().mean() > 0.99)
            agree = float((out == out_old).float().mean())
        except Exception as e:
            t, agree = None, repr(e)[:200]
        row["configs"].append(dict(BT=BT, BP=BP, warps=nw, us=t, tflops=None if t is None else flops / t / 1e6, bits_equal_share=agree))
        print(T, P, BT, BP, nw, t, agree, flush=True)
    for QN, BT, BP, nw in ((2, 16, 128, 4), (4, 16, 128, 8)):
        if T % BT: continue
        try:
            f = lambda: score_n[(T // BT, triton.cdiv(P, BP))](q, w, pk, tables, out, T, tables.shape[1], P, Di**-0.5,
                                                               KP=kp, BS=bs, HI=Hi, DI=Di, QN=QN, BT=BT, BP=BP, num_warps=nw)
            t = ev_time(f)
            agree = float((out == out_old).float().mean())
        except Exception as e:
            t, agree = None, repr(e)[:200]
        row["configs"].append(dict(QN=QN, BT=BT, BP=BP, warps=nw, us=t, tflops=None if t is None else flops / t / 1e6, bits_equal_share=agree))
        print("N-variant", T, P, QN, BT, BP, nw, t, agree, flush=True)
    print(f"T={T} P={P} old {t_old:.1f} us ({flops / t_old / 1e6:.0f} TFLOP/s)", flush=True)
    res.append(row)
    del pk, q, out, out_old; torch.cuda.empty_cache()
json.dump(dict(device=torch.cuda.get_device_name(), rows=res), open(os.environ.get("RES", "/tmp") + "/score_sweep.json", "w"), indent=1)
for r in res:
    best = min((c for c in r["configs"] if c["us"]), key=lambda c: c["us"])
    print(f"T={r['T']:5d} P={r['P']:7d} old {r['old_us']:9.1f} us {r['old_tflops']:5.0f} TF | best {best}")
