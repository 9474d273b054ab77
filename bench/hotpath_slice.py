"""The 4-layer full-width GLM-5.3-Flash slice on one GPU: decode steps and a long prefill against their floors.

The slice: 3 KDA layers + 1 MLA/DSA layer (full indexer, kpool 4), every MLP a 288-expert MoE, mHC, the
embedding, final norm and lm_head, random weights in bf16 (built in GPU memory, not read through the
checkpoint loader: writing and reading ~62 GB of safetensors does not fit the device time).

Measured, in this order (each part is written to the JSON as soon as it is done):
1. logits with the kernels against the reference path (two prompts of 300 and 77 tokens, then one decode
   step): relative error of the last-token logits;
2. decode steps at batch 1, 32 and 128 with ``--context`` tokens already cached (random cache contents:
   the work per step does not depend on them), eager and CUDA-graph replay, median of ``--steps``;
   floor = (bytes of the weights the step touches, experts counted from its actual routing, + cache
   bytes) / copy bandwidth measured in the same run;
3. a ``--prefill``-token prefill: FLOPs it needs / time / bf16 matmul rate measured in the same run.

usage: python bench/hotpath_slice.py --out bench/results/hotpath_slice.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from flashinfra.config import ModelConfig, resolve_text_config
from flashinfra.feedback import ceilings
from flashinfra.kernels import dispatch
from flashinfra.model import moe as moe_module
from flashinfra.model.api import LoadedModel
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.glm5_next import Glm5NextModel
from flashinfra.runner.cuda_graphs import DecodeGraphs

BS = 64
DEV = "cuda"
# --smoke: the same script at toy width on the CPU (under TRITON_INTERPRET=1), to check it before a GPU run
SMOKE = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, vocab_size=1000,
             num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16,
             index_topk=16, index_head_dim=16, index_n_heads=16, linear_head_dim=16, linear_num_heads=4)


def build_slice(device: str, smoke: bool) -> LoadedModel:
    cfg = resolve_text_config(dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["indexed_attention"],
                                   mlp_layer_types=["sparse"] * 4, indexer_types=["full"] * 4, index_kpool=4,
                                   **(SMOKE if smoke else {})))
    dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter's bf16 matrix product is not exact
    with torch.device(device):
        model = Glm5NextModel(cfg, dtype, has_lm_head=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in leaf and "bias" not in leaf:
                p.normal_(1.0, 0.1)
            elif leaf == "A_log":
                p.uniform_(0.0, 2.77)
            elif leaf == "scale":
                p.normal_(1.0, 0.1)
            elif p.dim() == 1 or leaf in ("pool_ape",):
                p.normal_(0.0, 0.1)
            elif leaf == "conv_weight":
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return LoadedModel(Path("random-slice"), ModelConfig(text=cfg), model.eval(), dtype,
                       torch.device(device), None)


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        if DEV != "cuda":
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def fill_cache(cache: ModelCache) -> None:
    for t in list(cache.mla_latent.values()) + list(cache.indexer_keys.values()) + list(cache.conv_state.values()):
        t.normal_()
    for t in cache.recurrent_state.values():
        t.normal_(0.0, 0.05)


class RoutingRecorder:
    """Wraps the MoE router to count, per layer call, the distinct experts a step touches."""

    def __init__(self):
        self.calls: list[int] = []
        self.inner = moe_module.route

    def __call__(self, *args, **kwargs):
        w, ids = self.inner(*args, **kwargs)
        self.calls.append(int(ids.unique().numel()))
        return w, ids


def weight_bytes(lm: LoadedModel, experts_touched: list[int], tokens: int) -> int:
    cfg, total = lm.config.text, 0
    for name, p in lm.model.named_parameters():
        if name == "embed_tokens":
            total += tokens * p.shape[1] * p.element_size()
        elif name.endswith("mlp.w13") or name.endswith("mlp.w2"):
            continue
        else:
            total += p.numel() * p.element_size()
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * 2
    return total + sum(experts_touched) * per_expert


def cache_bytes(cfg, context: int, batch: int) -> int:
    kda = len(cfg.kda_layers) * (2 * cfg.linear_num_heads * cfg.linear_head_dim**2 * 4
                                 + 2 * 3 * cfg.linear_dim * (cfg.linear_conv_kernel_dim - 1) * 2)
    selected = min(context + 1, cfg.index_topk + cfg.index_kpool - 1)
    mla = len(cfg.mla_layers) * selected * cfg.kv_lora_rank * 2
    indexer = len(cfg.indexer_layers) * (context + 1) * 2 * cfg.index_head_dim * 2
    return batch * (kda + mla + indexer)


def logits_check(lm: LoadedModel) -> dict:
    prompts = [torch.randint(1, 1000, (n,)).tolist() for n in (300, 77)]
    tables = [list(range(0, 6)), list(range(6, 8))]

    def run():
        cache = lm.allocate_cache(8, BS, 2)
        batch = ForwardBatch.build([300, 77], [0, 0], [0, 1], tables, BS, DEV)
        ids = torch.tensor(prompts[0] + prompts[1], device=DEV)
        h = lm.forward(ids, batch, cache)
        first = lm.compute_logits(h[torch.tensor([299, 376], device=DEV)])
        nxt = first.argmax(-1)
        batch = ForwardBatch.build([1, 1], [300, 77], [0, 1], tables, BS, DEV)
        return first, lm.compute_logits(lm.forward(nxt, batch, cache)), nxt

    fast = run()
    saved = dispatch._reference_forced
    dispatch._reference_forced = lambda: True
    try:
        ref = run()
    finally:
        dispatch._reference_forced = saved
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(fast[:2], ref[:2])]
    return dict(prefill_rel_err=rel[0], decode_rel_err=rel[1], same_prefill_argmax=bool(torch.equal(fast[2], ref[2])),
                max_abs_over_max_ref=float((fast[0] - ref[0]).abs().max() / ref[0].abs().max()))


def decode(lm: LoadedModel, batch_size: int, context: int, steps: int, ceil: dict) -> dict:
    cfg = lm.config.text
    W = -(-(context + 1) // BS)
    cache = lm.allocate_cache(batch_size * W + 1, BS, batch_size + 1)
    fill_cache(cache)
    tables = [list(range(b * W, (b + 1) * W)) for b in range(batch_size)]
    batch = ForwardBatch.build([1] * batch_size, [context] * batch_size, list(range(batch_size)), tables, BS, DEV)
    ids = torch.randint(1, 1000, (batch_size,), device=DEV)
    recorder = RoutingRecorder()
    moe_module.route = recorder
    try:
        lm.compute_logits(lm.forward(ids, batch, cache))
    finally:
        moe_module.route = recorder.inner
    eager = timed(lambda: lm.compute_logits(lm.forward(ids, batch, cache)), steps)
    if DEV == "cuda":
        graphs = DecodeGraphs(lm, cache, batch_size * W, batch_size)
        graphs.run(ids, batch)
        graph = timed(lambda: lm.compute_logits(graphs.run(ids, batch)), steps)
    else:
        graph = eager
    nbytes = weight_bytes(lm, recorder.calls, batch_size) + cache_bytes(cfg, context, batch_size)
    floor = nbytes / ceil["copy_bytes_per_s"]
    res = dict(batch=batch_size, context=context, experts_touched=recorder.calls, bytes=nbytes, floor_s=floor,
               eager_median_s=statistics.median(eager), graph_median_s=statistics.median(graph))
    res["graph_frac_hbm_roofline"] = floor / res["graph_median_s"]
    res["eager_frac_hbm_roofline"] = floor / res["eager_median_s"]
    del cache
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return res


def prefill_flops(lm: LoadedModel, T: int) -> int:
    cfg = lm.config.text
    dense = 0
    for name, p in lm.model.named_parameters():
        if p.dim() == 2 and name not in ("embed_tokens", "lm_head") and "conv_weight" not in name \
                and "kv_b_proj" not in name:
            dense += p.numel()
    experts = len(cfg.kda_layers + cfg.mla_layers) * cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    kp, sel = cfg.index_kpool, cfg.index_topk + cfg.index_kpool - 1
    pairs = sum(min(t + 1, sel) for t in range(T))
    pool_pairs = sum((t + 1) // kp for t in range(T))
    H, R = cfg.num_attention_heads, cfg.kv_lora_rank
    mla = len(cfg.mla_layers) * (4 * pairs * H * R + 2 * T * H * (cfg.qk_head_dim + cfg.v_head_dim) * R)
    indexer = len(cfg.indexer_layers) * 2 * pool_pairs * cfg.index_n_heads * cfg.index_head_dim
    kda = len(cfg.kda_layers) * T * cfg.linear_num_heads * cfg.linear_head_dim**2 * 2 * 3
    return 2 * T * (dense + experts) + mla + indexer + kda + 2 * cfg.vocab_size * cfg.hidden_size


def prefill(lm: LoadedModel, T: int, reps: int, ceil: dict) -> dict:
    W = -(-T // BS)
    ids = torch.randint(1, 1000, (T,), device=DEV)
    batch = ForwardBatch.build([T], [0], [0], [list(range(W))], BS, DEV)
    cache = lm.allocate_cache(W, BS, 1)

    def step():
        lm.compute_logits(lm.forward(ids, batch, cache)[-1:])

    step()
    times = timed(step, reps)
    flops = prefill_flops(lm, T)
    rate = ceil["matmul_flops_per_s_bfloat16"]
    med = statistics.median(times)
    return dict(tokens=T, median_s=med, times_s=times, flops=flops, frac_bf16_mfu=flops / med / rate)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/hotpath_slice.json")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU, to check the script")
    args = ap.parse_args()
    global DEV
    DEV = "cpu" if args.smoke else "cuda"
    report = dict(date=datetime.now(timezone.utc).isoformat(),
                  device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)",
                  command="python bench/hotpath_slice.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(report, indent=2))

    report["ceilings"] = ceil = ceilings.measure(DEV, quick=args.smoke)
    if "matmul_flops_per_s_bfloat16" not in ceil:
        ceil["matmul_flops_per_s_bfloat16"] = ceil["matmul_flops_per_s"]
    lm = build_slice(DEV, args.smoke)
    save()
    report["logits_vs_reference"] = logits_check(lm)
    print("logits", report["logits_vs_reference"], flush=True)
    save()
    report["decode"] = []
    for b in (int(x) for x in args.batches.split(",")):
        report["decode"].append(decode(lm, b, args.context, args.steps, ceil))
        print("decode", report["decode"][-1], flush=True)
        save()
    report["prefill"] = prefill(lm, args.prefill, 3, ceil)
    print("prefill", report["prefill"], flush=True)
    save()


if __name__ == "__main__":
    main()
