"""The 8-bit GEMMs' decode tiles: each of the slice's dense projections at one row (W8A8 int8 weights, and FP8 with
128 x 128 block scales, rotated through copies past L2 so every call streams from memory) and the int8 fused MoE at
1 and 16 tokens (9 pairs a token), for the shipped tile against candidates. Per-kernel device time without
programmatic dependent launch (whose waits would be counted in), the fraction of the byte floor at the copy bandwidth
measured in the run, and every candidate's output checked equal to the shipped tile's.

    python3 bench/quant_decode_tiles.py --out bench/results/quant_decode_tiles.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from flashinfra.feedback import ceilings
from flashinfra.feedback.timing import header, kernel_times_us, write_results
from flashinfra.kernels import fused_moe as fm
from flashinfra.kernels.launch import without_pdl
from flashinfra.kernels.quant import gemm
from flashinfra.kernels.quant.act import FP8_DTYPE, GROUP, quant_act

# (N, K) of the slice's 8-bit projections at decode: KDA in_proj and o_proj, MLA qkv_a, q_b and o_proj, the
# indexer's wq_b, the head
DENSE = [(24896, 4096), (4096, 8192), (2048, 4096), (16384, 1536), (4096, 16384), (4096, 1536), (154880, 4096)]
E, D, I, TOPK = 288, 4096, 2048, 8
ROTATE_BYTES = 256 * 2**20  # weight copies per shape: at least this many bytes, five times the H100's L2


def _dense_candidates(fmt: str) -> list[dict]:
    ks = (256, 512) if fmt == "int8" else (GROUP,)  # fp8 steps K by its scales' block
    return [dict(BM=16, BN=bn, BK=bk, num_warps=4, num_stages=st)
            for bn, bk, st in itertools.product((16, 32, 64), ks, (4, 6))]


def _weights(fmt: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt == "int8":
        return torch.randint(-127, 128, (N, K), device="cuda", dtype=torch.int8), torch.rand(N, device="cuda") * 1e-3
    w = (torch.rand(N, K, device="cuda") * 2 - 1).to(FP8_DTYPE)
    return w, torch.rand(-(-N // GROUP), -(-K // GROUP), device="cuda") * 1e-3


def dense_rows(bw: float, fmt: str) -> list[dict]:
    rows, shipped_fn = [], gemm._config
    for N, K in DENSE:
        copies = max(1, -(-ROTATE_BYTES // (N * K)))
        ws, ss = zip(*[_weights(fmt, N, K) for _ in range(copies)])
        xq, sx = quant_act(fmt, torch.randn(1, K, device="cuda", dtype=torch.bfloat16))
        ref = gemm.matmul_8bit_launch(xq, sx, ws[0], ss[0]).clone()
        shipped = shipped_fn(1, N, fmt)
        for cfg in [shipped] + [c for c in _dense_candidates(fmt) if c != shipped]:
            gemm._config = lambda M, N_, fmt, cfg=cfg: cfg
            try:
                same = bool(torch.equal(gemm.matmul_8bit_launch(xq, sx, ws[0], ss[0]), ref))
                with without_pdl():
                    kt = kernel_times_us(lambda: [gemm.matmul_8bit_launch(xq, sx, w, s) for w, s in zip(ws, ss)])
            finally:
                gemm._config = shipped_fn
            us = sum(v for k, v in kt.items() if "matmul_8bit" in k) / copies
            rows.append(dict(format=fmt, N=N, K=K, cfg=cfg, shipped=cfg == shipped, us=us,
                             of_floor=N * K / bw / (us * 1e-6), same=same))
    return rows


MOE_CANDIDATES = [(64, 64, 128, 4), (32, 64, 128, 3), (32, 64, 128, 4), (32, 64, 256, 3), (32, 32, 128, 3),
                  (64, 64, 256, 3), (16, 64, 128, 4)]  # BN1, BN2, BK, stages


def moe_rows(bw: float) -> list[dict]:
    w13 = torch.randint(-127, 128, (E, 2 * I, D), device="cuda", dtype=torch.int8)
    w2 = torch.randint(-127, 128, (E, D, I), device="cuda", dtype=torch.int8)
    s13, s2 = (torch.randint(-127, 128, (2 * I, D), device="cuda", dtype=torch.int8),
               torch.randint(-127, 128, (D, I), device="cuda", dtype=torch.int8))
    scales = (torch.rand(E, 2 * I, device="cuda") * 1e-3, torch.rand(E, D, device="cuda") * 1e-3,
              torch.rand(2 * I, device="cuda") * 1e-3, torch.rand(D, device="cuda") * 1e-3)
    rows, shipped_fn = [], fm.moe_tiles
    for T in (1, 16):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(T, TOPK, device="cuda")
        ids = torch.rand(T, E, device="cuda").argsort(-1)[:, :TOPK].to(torch.int32)
        experts = len(set(ids.flatten().tolist())) + 1  # and the shared one
        run = lambda: fm.fused_moe_launch(x, w13, w2, w, ids, 10.0, s13, s2, scales)  # noqa: E731
        ref = run().clone()
        shipped = shipped_fn(T * (TOPK + 1), E + 1, 1)
        cands = [dict(BM=16, BN1=b1, BN2=b2, BK=bk, num_warps=4, num_stages=st) for b1, b2, bk, st in MOE_CANDIDATES]
        for cfg in [shipped] + [c for c in cands if c != shipped]:
            fm.moe_tiles = lambda *a, cfg=cfg, **kw: cfg
            try:
                same = bool(torch.equal(run(), ref))
                with without_pdl():
                    kt = kernel_times_us(run, calls=10)
            finally:
                fm.moe_tiles = shipped_fn
            g1 = sum(v for n, v in kt.items() if "gemm1" in n)
            g2 = sum(v for n, v in kt.items() if "gemm2" in n)
            rows.append(dict(T=T, cfg=cfg, shipped=cfg == shipped, gemm1_us=g1, gemm2_us=g2,
                             gemm1_of_floor=experts * 2 * I * D / bw / (g1 * 1e-6),
                             gemm2_of_floor=experts * D * I / bw / (g2 * 1e-6), same=same))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/quant_decode_tiles.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    report = header()
    bw = report["copy_bytes_per_s"] = ceilings.measure("cuda")["copy_bytes_per_s"]
    report["dense"] = dense = dense_rows(bw, "int8") + dense_rows(bw, "fp8")
    report["moe"] = moe = moe_rows(bw)
    report["not_same"] = [r["cfg"] for r in dense + moe if not r["same"]]
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)
    for fmt, (N, K) in itertools.product(("int8", "fp8"), DENSE):
        rs = [r for r in dense if (r["format"], r["N"], r["K"]) == (fmt, N, K)]
        s, b = next(r for r in rs if r["shipped"]), min(rs, key=lambda r: r["us"])
        print(f"{fmt} {N:>6} x {K:<5} shipped {s['us']:6.1f} us ({s['of_floor']:.2f})  best {b['us']:6.1f} us "
              f"({b['of_floor']:.2f}) {b['cfg']}")
    for T in (1, 16):
        rs = [r for r in moe if r["T"] == T]
        s = next(r for r in rs if r["shipped"])
        b1, b2 = min(rs, key=lambda r: r["gemm1_us"]), min(rs, key=lambda r: r["gemm2_us"])
        print(f"MoE T={T}: shipped gemm1 {s['gemm1_us']:.1f} gemm2 {s['gemm2_us']:.1f} us; best gemm1 "
              f"{b1['gemm1_us']:.1f} {b1['cfg']}, gemm2 {b2['gemm2_us']:.1f} {b2['cfg']}")
    print("outputs differing from the shipped tile's:", report["not_same"] or "none")


if __name__ == "__main__":
    main()
