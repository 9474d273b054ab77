"""Sweep of the fused MoE's prefill tiles (16-bit): 8192 tokens, 288 experts top-8 + shared, D 4096, I 2048."""
import json, os, itertools
import torch
from flashinfra.kernels import fused_moe as fm
from flashinfra.feedback.timing import kernel_times_us

T, E, D, I, k = 8192, 288, 4096, 2048, 8
torch.manual_seed(0)
w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * I**-0.5
s13 = torch.randn(2 * I, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
s2 = torch.randn(D, I, device="cuda", dtype=torch.bfloat16) * I**-0.5
x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
w = torch.rand(T, k, device="cuda")
ids = torch.rand(T, E, device="cuda").argsort(-1)[:, :k].to(torch.int32)
flops1 = 2 * T * (k + 1) * 2 * I * D
flops2 = 2 * T * (k + 1) * I * D
ref = fm.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2).clone()
base = dict(fm.LARGE_TILES[2])
cands = [base,
         dict(base, BN2=256),
         dict(base, num_stages=4),
         dict(base, BN2=256, num_stages=4),
         dict(base, BM=64, BN1=128, BN2=256, num_warps=4, num_stages=4),
         dict(base, BN1=64, BN2=256, num_stages=4),
         dict(base, BM=256, BN1=64, BN2=128, num_stages=3),
         ]
rows = []
for c in cands:
    fm.LARGE_TILES[2] = c
    try:
        y = fm.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2)
        err = float((y.float() - ref.float()).abs().max())
        kt = kernel_times_us(lambda: fm.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2), calls=5)
        g1 = sum(v for n, v in kt.items() if "gemm1" in n); g2 = sum(v for n, v in kt.items() if "gemm2" in n)
        r = dict(cfg=c, gemm1_us=g1, gemm2_us=g2, total_us=sum(kt.values()), gemm1_tflops=flops1 / g1 / 1e6,
                 gemm2_tflops=flops2 / g2 / 1e6, max_abs_diff=err)
    except Exception as e:
        r = dict(cfg=c, error=repr(e)[:300])
    print(r, flush=True)
    rows.append(r)
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(os.environ.get("RES", "/tmp") + "/moe_sweep.json", "w"), indent=1)
for r in rows:
    if "error" in r: print("ERR", r["cfg"], r["error"][:80]); continue
    print(f"{str(r['cfg']):90s} g1 {r['gemm1_us']:8.0f} us {r['gemm1_tflops']:4.0f} TF  g2 {r['gemm2_us']:8.0f} us {r['gemm2_tflops']:4.0f} TF  tot {r['total_us']:8.0f}  diff {r['max_abs_diff']:.3g}")
