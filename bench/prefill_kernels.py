"""The long prefill's two largest kernels against a given revision's, in one run (issue #40: the 1M prompt and the 8k
prompt; issue #39: the W8A8 prefill):

- ``score``: the DSA indexer's scoring kernel (``dsa_indexer.scores_launch``), 256 queries (one ``KEY_BUFFER_BYTES``
  slice of a late 8192-token step) and one decode query, each against 262,144 pools (1M context, kpool 4, 32 heads
  x 128, block size 16, a shuffled block table). Floor: its FLOPs at the measured bf16 matmul rate (the slice), the
  pool keys' bytes at the copy rate (decode). Each result's largest error against a float32 computation of two
  queries' scores is reported beside it.
- ``moe``: the fused MoE of an 8192-token prompt (288 experts top-8 + the shared one, D 4096, I 2048), bf16, W8A8
  int8 and block-FP8, per GEMM (profiler kernel times). Floor: the larger of its FLOPs at the matmul rate and its
  weights' bytes at the copy rate.

``--configs`` adds the scoring kernel at other tiles (the module's ``SCORE_*`` constants) and the MoE at other
long-prefill tiles (``fused_moe.LARGE_TILES``) to choose them.

    python bench/prefill_kernels.py --before f7558ff --configs --out bench/results/prefill_kernels.json
    python bench/prefill_kernels.py --before HEAD --parts score --out bench/results/prefill_kernels_score.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from revisions import revision_module

from flashinfra.feedback import ceilings
from flashinfra.feedback.timing import call_times_us, header, kernel_times_us, write_results
from flashinfra.kernels import dsa_indexer, fused_moe

HI, DI, KPOOL, BS, CONTEXT = 32, 128, 4, 16, 1 << 20
T_MOE, E, D, I, K = 8192, 288, 4096, 2048, 8
# (queries per product, queries per program, pools per program, warps, stages)
SCORE_CONFIGS = [(2, 32, 128, 4, 3), (2, 64, 128, 4, 3), (2, 32, 256, 4, 3), (2, 32, 256, 8, 3), (2, 64, 256, 8, 3),
                 (2, 16, 128, 4, 2), (4, 16, 128, 4, 2)]
# (BM, BN1, BN2, BK, warps, stages) by weight bytes: gemm1 keeps two [BM, BN1] accumulators (gate and up)
MOE_CONFIGS = {2: [(128, 128, 128, 64, 8, 3), (128, 64, 128, 64, 8, 3), (128, 64, 128, 64, 8, 4),
                   (128, 64, 128, 64, 4, 3), (128, 64, 64, 64, 4, 4), (64, 128, 128, 64, 4, 3)],
               1: [(128, 128, 128, 128, 8, 3), (128, 64, 128, 128, 8, 3), (128, 64, 128, 128, 8, 4),
                   (128, 64, 128, 128, 4, 3)]}


def from_bits(bits: torch.Tensor) -> torch.Tensor:
    """The scores' floats from their order bits (``dsa_topk.score_bits`` inverted)."""
    b = bits.clone()
    b[b < 0] ^= 0x7FFFFFFF
    return b.view(torch.float32)


def score_rows(before, ceil: dict, configs: bool) -> list[dict]:
    P, W = CONTEXT // KPOOL, CONTEXT // BS
    torch.manual_seed(0)
    keys = torch.randn(W + 8, BS // KPOOL, DI, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(W + 8, device="cuda")[:W].to(torch.int32)[None].contiguous()
    dense = keys[tables[0].long()].reshape(P, DI).float()
    rows = []
    for T in (256, 1):
        q = torch.randn(T, HI, DI, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(T, HI, device="cuda")
        seq = torch.zeros(T, dtype=torch.int32, device="cuda")
        pos = torch.arange(CONTEXT - T, CONTEXT, dtype=torch.int32, device="cuda")
        probe = [0, T - 1]
        ref = torch.stack([(w[t, :, None] * torch.relu(q[t].float() @ dense.T * DI**-0.5)).sum(0) for t in probe])
        seen = torch.arange(P, device="cuda")[None] * KPOOL + KPOOL - 1 <= pos[probe, None]

        def run(module):
            out = torch.full((T, P), 0x7F7F7F7F, dtype=torch.int32, device="cuda")  # poisoned
            # best of three batches of ten calls, between CUDA events
            us = min(call_times_us(lambda: module.scores_launch(keys, q, w, tables, seq, pos, KPOOL, out), calls=10,
                                   iters=3, warmup=1))
            return us, float((from_bits(out[probe]) - ref)[seen].abs().max())

        flops, nbytes = 2 * T * P * HI * DI, P * DI * 2 + 4 * T * P
        floor_us = max(flops / ceil["matmul_flops_per_s_bfloat16"], nbytes / ceil["copy_bytes_per_s"]) * 1e6
        row = dict(T=T, P=P, flops=flops, bytes=nbytes, floor_us=floor_us)
        row["before_us"], row["before_max_err"] = run(before)
        row["now_us"], row["now_max_err"] = run(dsa_indexer)
        row.update(speedup=row["before_us"] / row["now_us"], now_tflops=flops / row["now_us"] / 1e6,
                   now_floor_fraction=floor_us / row["now_us"], before_floor_fraction=floor_us / row["before_us"])
        if configs:
            names = ("SCORE_COLUMN_QUERIES", "SCORE_QUERIES", "SCORE_POOLS", "SCORE_WARPS", "SCORE_STAGES")
            shipped = [getattr(dsa_indexer, n) for n in names]
            row["configs"] = []
            for cfg in SCORE_CONFIGS:
                for n, v in zip(names, cfg):
                    setattr(dsa_indexer, n, v)
                us, err = run(dsa_indexer)
                row["configs"].append(dict(zip(("QN", "BT", "BP", "warps", "stages"), cfg), us=us, max_err=err,
                                           tflops=flops / us / 1e6))
            for n, v in zip(names, shipped):
                setattr(dsa_indexer, n, v)
        print(f"score T={T}: before {row['before_us']:.1f} us, now {row['now_us']:.1f} us "
              f"({row['speedup']:.2f}x, {row['now_tflops']:.0f} TFLOP/s, {row['now_floor_fraction']:.0%} of floor)",
              flush=True)
        rows.append(row)
    return rows


def moe_times(module, x, args, flops: dict) -> dict:
    times = kernel_times_us(lambda: module.fused_moe_launch(x, *args), calls=5)
    parts = {g: sum(v for n, v in times.items() if f"moe_{g}_kernel" in n) for g in flops}
    return dict(total_us=sum(times.values()), **{f"{g}_us": us for g, us in parts.items()},
                **{f"{g}_tflops": flops[g] / us / 1e6 for g, us in parts.items()})


def moe_rows(before, ceil: dict, configs: bool) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(T_MOE, D, device="cuda", dtype=torch.bfloat16)
    topk_w = torch.rand(T_MOE, K, device="cuda")
    ids = torch.rand(T_MOE, E, device="cuda").argsort(-1)[:, :K].to(torch.int32)
    pairs = T_MOE * (K + 1)
    flops = {"gemm1": 2 * pairs * 2 * I * D, "gemm2": 2 * pairs * I * D}
    rows = []
    for fmt in ("bfloat16", "int8", "fp8"):
        if fmt == "bfloat16":
            w13 = torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
            w2 = torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * I**-0.5
            s13 = torch.randn(2 * I, D, device="cuda", dtype=torch.bfloat16) * D**-0.5
            s2 = torch.randn(D, I, device="cuda", dtype=torch.bfloat16) * I**-0.5
            args, rate = (w13, w2, topk_w, ids, 10.0, s13, s2), ceil["matmul_flops_per_s_bfloat16"]
        elif fmt == "int8":  # int8 codes with per-channel scales; the int8 tensor-core rate taken as twice bf16's
            def codes(*shape):
                return torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)
            scales = (torch.rand(E, 2 * I, device="cuda") * 1e-3, torch.rand(E, D, device="cuda") * 1e-3,
                      torch.rand(2 * I, device="cuda") * 1e-3, torch.rand(D, device="cuda") * 1e-3)
            args = (codes(E, 2 * I, D), codes(E, D, I), topk_w, ids, 10.0, codes(2 * I, D), codes(D, I), scales)
            rate = 2 * ceil["matmul_flops_per_s_bfloat16"]
        elif fmt == "fp8":  # e4m3 codes with one scale per 128 x 128 block; the fp8 rate taken as twice bf16's
            def codes(*shape):
                return torch.randn(shape, device="cuda").to(torch.float8_e4m3fn)

            def block_scales(*shape):
                return torch.rand(*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128), device="cuda") * 1e-3
            shapes = ((E, 2 * I, D), (E, D, I), (2 * I, D), (D, I))
            w13, w2, s13, s2 = (codes(*sh) for sh in shapes)
            args = (w13, w2, topk_w, ids, 10.0, s13, s2, tuple(block_scales(*sh) for sh in shapes))
            rate = 2 * ceil["matmul_flops_per_s_bfloat16"]
        weight_bytes = sum(a.numel() * a.element_size() for a in args[:2] + args[5:7])
        row = dict(format=fmt, T=T_MOE, pairs=pairs, flops=sum(flops.values()), weight_bytes=weight_bytes,
                   floor_us=max(sum(flops.values()) / rate, weight_bytes / ceil["copy_bytes_per_s"]) * 1e6)
        want = fused_moe.fused_moe_launch(x, *args).float()
        for side, module in (("before", before), ("now", fused_moe)):
            got = module.fused_moe_launch(x, *args).float()
            row[side] = moe_times(module, x, args, flops) | dict(max_abs_diff_to_now=float((got - want).abs().max()))
        if configs and fmt != "fp8":  # fp8 runs int8's tiles
            elem = 2 if fmt == "bfloat16" else 1
            shipped, row["configs"] = fused_moe.LARGE_TILES[elem], []
            for cfg in MOE_CONFIGS[elem]:
                tile = dict(zip(("BM", "BN1", "BN2", "BK", "num_warps", "num_stages"), cfg))
                fused_moe.LARGE_TILES[elem] = tile
                got = fused_moe.fused_moe_launch(x, *args).float()
                row["configs"].append(tile | moe_times(fused_moe, x, args, flops)
                                      | dict(max_abs_diff_to_now=float((got - want).abs().max())))
                c = row["configs"][-1]
                print(f"moe {fmt} {cfg}: {c['total_us']:.0f} us (gemm1 {c['gemm1_us']:.0f}, gemm2 {c['gemm2_us']:.0f})",
                      flush=True)
            fused_moe.LARGE_TILES[elem] = shipped
        row.update(speedup=row["before"]["total_us"] / row["now"]["total_us"],
                   now_floor_fraction=row["floor_us"] / row["now"]["total_us"])
        print(f"moe {fmt}: before {row['before']['total_us']:.0f} us, now {row['now']['total_us']:.0f} us "
              f"({row['speedup']:.2f}x, {row['now_floor_fraction']:.0%} of floor)", flush=True)
        rows.append(row)
        del args
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the git revision whose kernels to time beside this tree's")
    ap.add_argument("--before-dir", help="that revision's dsa_indexer.py and fused_moe.py, exported here (git show)")
    ap.add_argument("--configs", action="store_true", help="also the scoring kernel and the MoE at other tiles")
    ap.add_argument("--parts", default="score,moe", help="comma-separated subset of score,moe")
    ap.add_argument("--out", default="bench/results/prefill_kernels.json")
    args = ap.parse_args()
    ceil = ceilings.measure("cuda")
    report = header() | dict(before=args.before, ceilings=ceil)
    parts = {"score": ("dsa_indexer", score_rows), "moe": ("fused_moe", moe_rows)}
    for part in args.parts.split(","):
        module, rows = parts[part]
        report[part] = rows(revision_module(args.before, f"flashinfra/kernels/{module}.py", args.before_dir), ceil,
                            args.configs)
    out = Path(args.out)
    write_results(out.stem, report, directory=out.parent)
    print("| kernel | before | now | speedup | of floor |\n| --- | --- | --- | --- | --- |")
    for r in report.get("score", []):
        print(f"| score T={r['T']} | {r['before_us']:.1f} us | {r['now_us']:.1f} us | {r['speedup']:.2f}x "
              f"| {r['now_floor_fraction']:.0%} |")
    for r in report.get("moe", []):
        print(f"| moe {r['format']} T={r['T']} | {r['before']['total_us']:.0f} us | {r['now']['total_us']:.0f} us "
              f"| {r['speedup']:.2f}x | {r['now_floor_fraction']:.0%} |")


if __name__ == "__main__":
    main()
