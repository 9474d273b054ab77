"""The kernel part of ``quant.py``: the tensor-core peaks measured in the run, the slice's dense projections and its
288-expert MoE per weight format (TFLOP/s, fraction of that format's peak), and the RMSNorm with the projection it
feeds (bf16; W8A8 with the activation quantization a kernel of its own; W8A8 with it in the norm's epilogue); and
the timing helpers both use."""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.nn.functional as F

from flashinfra.kernels.fused_moe import fused_moe
from flashinfra.kernels.norms import rms_norm
from flashinfra.kernels.quant import linear_8bit, matmul_8bit, rms_norm_int8
from flashinfra.quant.weights import quantize_fp8_blocks, quantize_int8_per_channel


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_s(fn, dev: str, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def peaks(dev: str, n: int, reps: int) -> dict:
    a = torch.randn(n, n, device=dev)
    ab = a.bfloat16()
    out = {"bf16": 2 * n**3 / median_s(lambda: ab @ ab, dev, reps) / 1e12}
    if dev == "cuda":
        i8 = torch.randint(-127, 128, (n, n), device=dev, dtype=torch.int8)
        out["int8"] = 2 * n**3 / median_s(lambda: torch._int_mm(i8, i8.t()), dev, reps) / 1e12
        try:
            f8 = a.to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev)
            out["fp8"] = 2 * n**3 / median_s(lambda: torch._scaled_mm(f8, f8.t(), one, one, out_dtype=torch.bfloat16),
                                             dev, reps) / 1e12
        except Exception as e:  # noqa: BLE001 - an fp8-less device: recorded
            out["fp8_error"] = repr(e)
    return out


def gemms(dev: str, cfg, tokens: tuple[int, ...], peak: dict, reps: int) -> list[dict]:
    H, K = cfg.linear_num_heads, cfg.linear_head_dim
    D = cfg.hidden_size
    shapes = {"kda.in_proj": (3 * H * K + 2 * K + H, D), "kda.o_proj": (D, H * K),
              "mla.q_b_proj": (cfg.num_attention_heads * cfg.qk_head_dim, cfg.q_lora_rank),
              "mla.o_proj": (D, cfg.num_attention_heads * cfg.v_head_dim)}
    rows = []
    for name, (N, Kd) in shapes.items():
        w = torch.randn(N, Kd, device=dev) * Kd**-0.5
        wb, qi, qf = w.bfloat16(), quantize_int8_per_channel(w), quantize_fp8_blocks(w)
        for M in tokens:
            x = torch.randn(M, Kd, device=dev).bfloat16()
            flops = 2 * M * N * Kd
            runs = {"bf16": lambda: F.linear(x, wb), "w8a8": lambda: linear_8bit(x, qi.data, qi.scale)}
            if "fp8" in peak:
                runs["fp8"] = lambda: linear_8bit(x, qf.data, qf.scale)
            for fmt, fn in runs.items():
                s = median_s(fn, dev, reps)
                key = {"bf16": "bf16", "w8a8": "int8", "fp8": "fp8"}[fmt]
                rows.append(dict(op=name, tokens=M, format=fmt, us=s * 1e6, tflops=flops / s / 1e12,
                                 of_peak=flops / s / 1e12 / peak[key] if key in peak else None))
    return rows


def norm_gemms(dev: str, cfg, tokens: tuple[int, ...], reps: int) -> list[dict]:
    """The input RMSNorm and the projection it feeds (KDA ``in_proj``, MLA ``qkv_a_proj``): bf16, W8A8 with the
    separate activation quantization kernel (norm, quantize, GEMM: three launches), and W8A8 with the quantization
    in the norm's epilogue (``rms_norm_int8``, then the GEMM on its codes: two launches)."""
    H, K, D = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
    shapes = {"kda.in_proj": 3 * H * K + 2 * K + H, "mla.qkv_a_proj": cfg.q_lora_rank + cfg.kv_lora_rank}
    nw = torch.ones(D, device=dev, dtype=torch.bfloat16)
    rows = []
    for name, N in shapes.items():
        w = torch.randn(N, D, device=dev) * D**-0.5
        wb, qi = w.bfloat16(), quantize_int8_per_channel(w)
        for M in tokens:
            x = torch.randn(M, D, device=dev).bfloat16()

            def fused():
                _, q, s = rms_norm_int8(x, nw, 1e-5, False)
                return matmul_8bit(q, s, qi.data, qi.scale, out_dtype=torch.bfloat16)

            runs = {"bf16": lambda: F.linear(rms_norm(x, nw, 1e-5), wb),
                    "w8a8": lambda: linear_8bit(rms_norm(x, nw, 1e-5), qi.data, qi.scale),
                    "w8a8_fused_norm": fused}
            for fmt, fn in runs.items():
                rows.append(dict(op=f"rms_norm + {name}", tokens=M, format=fmt, us=median_s(fn, dev, reps) * 1e6))
    return rows


def _expert_weights(E: int, N: int, K: int, dev: str):
    """Random [E, N, K] experts as bf16, int8 per channel and fp8 per block, made 32 experts at a time (the
    float32 temporaries of all 288 at once would take tens of GB)."""
    parts = []
    for e0 in range(0, E, 32):
        w = torch.randn(min(32, E - e0), N, K, device=dev) * K**-0.5
        parts.append((w.bfloat16(), quantize_int8_per_channel(w), quantize_fp8_blocks(w)))
        del w
    b = torch.cat([p[0] for p in parts])
    qi = type(parts[0][1])(torch.cat([p[1].data for p in parts]), torch.cat([p[1].scale for p in parts]), "w8a8")
    qf = type(parts[0][2])(torch.cat([p[2].data for p in parts]), torch.cat([p[2].scale for p in parts]), "fp8")
    return b, qi, qf


def moes(dev: str, cfg, tokens: tuple[int, ...], peak: dict, reps: int) -> list[dict]:
    """Routed experts plus a shared expert as one more pair per token (``fused_moe``'s form; expert 0's weights
    stand in for the shared expert's), so every format does the same ``k + 1`` pairs of work."""
    E, k, D, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    b13, i13, f13 = _expert_weights(E, 2 * I, D, dev)
    b2, i2, f2 = _expert_weights(E, D, I, dev)
    s13, s2 = b13[0].clone(), b2[0].clone()
    rows = []
    for T in tokens:
        x = torch.randn(T, D, device=dev).bfloat16()
        ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)]).int()
        tw = torch.rand(T, k, device=dev)
        flops = 2 * T * (k + 1) * 3 * D * I
        runs = {"bf16": lambda: fused_moe(x, b13, b2, tw, ids, 10.0, s13, s2),
                "w8a8": lambda: fused_moe(x, i13.data, i2.data, tw, ids, 10.0, i13.data[0], i2.data[0],
                                          (i13.scale, i2.scale, i13.scale[0], i2.scale[0]))}
        if "fp8" in peak:
            runs["fp8"] = lambda: fused_moe(x, f13.data, f2.data, tw, ids, 10.0, f13.data[0], f2.data[0],
                                            (f13.scale, f2.scale, f13.scale[0], f2.scale[0]))
        for fmt, fn in runs.items():
            s = median_s(fn, dev, reps)
            key = {"bf16": "bf16", "w8a8": "int8", "fp8": "fp8"}[fmt]
            rows.append(dict(op=f"moe ({E} experts, top-{k}, + shared)", tokens=T, format=fmt, us=s * 1e6,
                             tflops=flops / s / 1e12, of_peak=flops / s / 1e12 / peak[key] if key in peak else None))
    return rows
