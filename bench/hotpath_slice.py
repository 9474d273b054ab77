"""The 4-layer full-width GLM-5.3-Flash slice on one GPU: decode steps and a long prefill against their
floors, and transformers on the same slice in the same run.

The slice: 3 KDA layers + 1 MLA/DSA layer (full indexer, kpool 4), every MLP a 288-expert MoE, mHC, the
embedding and final norm, random weights in bf16: transformers' ``Glm5NextTextModel`` built as the anchor
did (random init, bf16, sdpa, on the GPU), and ours from its ``state_dict()`` through the normal loader
(``load_model_from_state_dict``), so both run the same weights. A bare text model has no lm_head: our
logits use the embedding. Order (each part is written to the JSON as soon as it is done):
0. transformers (``--no-transformers`` skips it; ours then loads random release-format tensors): after
   an untimed warm-up, the anchor's method: a 2048-token prefill at batch 1 timed once, then
   ``--hf-steps`` decode steps timed after 2 untimed ones; the same at batch 32 after 512 tokens. It is
   freed before ours runs;
1. accuracy: the kernel path's logits against the reference path's end to end, and layer by layer
   against the reference path in float32 (see ``logits_check``);
2. decode steps at batch 1, 32 and 128 with ``--context`` tokens cached (random cache contents), eager and
   CUDA-graph replay, median of ``--steps``; floor = (bytes of the weights the step touches, experts
   counted from its routing, + cache bytes) / copy bandwidth measured in the same run;
3. a ``--prefill``-token prefill: FLOPs it needs / time / bf16 matmul rate measured in the same run;
4. ours at transformers' contexts and prompt length; speed-ups (transformers' time / ours) at its
   contexts and at ours, updated as each part ends. Details: ``bench/notes/hotpath_slice.md``.

usage: python bench/hotpath_slice.py --out bench/results/hotpath_slice.json [--smoke] [--no-transformers]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from pathlib import Path

import torch
from hotpath_transformers import HF_RUNS, SMOKE_HF_RUNS, build_hf, measure_hf, speedups

from flashinfra.feedback import ceilings
from flashinfra.feedback.timing import call_times_us, header, write_results
from flashinfra.model import moe as moe_module
from flashinfra.model.api import LoadedModel, load_model_from_state_dict, model_config_from, random_model
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.layerwise import compare_layers, kernel_path
from flashinfra.engine.cuda_graphs import DecodeGraphs

BS = 64
DEV = "cuda"
# --smoke: the same script at toy width on the CPU (under TRITON_INTERPRET=1), to check it before a GPU run
SMOKE = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, vocab_size=1000,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
             v_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16, linear_head_dim=16,
             linear_num_heads=4, pad_token_id=0)


def slice_config(smoke: bool) -> dict:
    """The anchor's config (transformers' defaults otherwise: 3 KDA + 1 MLA layer, full indexers)."""
    cfg = dict(num_hidden_layers=4, mlp_layer_types=["sparse"] * 4, index_kpool=4, **(SMOKE if smoke else {}))
    text = model_config_from(cfg).text
    assert text.kda_layers == (0, 1, 2) and text.mla_layers == (3,) and text.indexer_layers == (3,), text
    return cfg


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def gpu_gb() -> dict:
    if DEV != "cuda":
        return {}
    return dict(allocated_gb=torch.cuda.memory_allocated() / 1e9, peak_gb=torch.cuda.max_memory_allocated() / 1e9)


def timed(fn, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls, each timed alone (CUDA events on the GPU, perf_counter on the CPU)."""
    return [us / 1e6 for us in call_times_us(fn, calls=1, iters=reps, warmup=0, device=DEV)]


def fill_cache(cache: ModelCache) -> None:
    for t in (list(cache.mla_latent.values()) + list(cache.indexer_keys.values())
              + list(cache.indexer_pool_keys.values()) + list(cache.conv_state.values())):
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
            if not lm.config.has_lm_head:  # the logits read the whole embedding
                total += p.numel() * p.element_size()
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
    """End to end (two prompts of 300 and 77 tokens, then one decode step fed the reference's tokens):
    the kernel path's last-token logits against the reference path's, both bf16. A random bf16 slice is
    chaotic (a one-ulp change of a router score moves a token to another expert, and after four layers
    equally valid roundings give different logits), so this is reported, and accuracy is judged layer by
    layer (``layers``): each layer fed the reference's input, kernel path and reference path both
    compared with the reference path run in float32 (``flashinfra.model.layerwise``)."""
    prompts = [torch.randint(1, 1000, (n,)).tolist() for n in (300, 77)]
    tables = [list(range(0, 6)), list(range(6, 8))]

    def run(nxt=None):
        cache = lm.allocate_cache(8, BS, 2)
        batch = ForwardBatch.build([300, 77], [0, 0], [0, 1], tables, BS, DEV)
        ids = torch.tensor(prompts[0] + prompts[1], device=DEV)
        h = lm.forward(ids, batch, cache)
        first = lm.compute_logits(h[torch.tensor([299, 376], device=DEV)])
        nxt = first.argmax(-1) if nxt is None else nxt
        batch = ForwardBatch.build([1, 1], [300, 77], [0, 1], tables, BS, DEV)
        return first, lm.compute_logits(lm.forward(nxt, batch, cache)), nxt

    with kernel_path(False):
        ref = run()
    fast = run(ref[2])
    rel = [float((a - b).norm() / b.norm()) for a, b in zip(fast[:2], ref[:2])]
    layers = compare_layers(lm, prompts, torch.float64 if DEV == "cpu" else torch.float32, block_size=BS)
    return dict(prefill_rel_err=rel[0], decode_rel_err=rel[1],
                same_prefill_argmax=bool(torch.equal(fast[0].argmax(-1), ref[0].argmax(-1))),
                layers=[dataclasses.asdict(e) for e in layers],
                layers_within_2x_reference=all(e.within(2.0, 1e-3) for e in layers))


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
    return res


def prefill_flops(lm: LoadedModel, T: int) -> int:
    cfg = lm.config.text
    dense = 0
    for name, p in lm.model.named_parameters():
        if p.dim() == 2 and name not in ("embed_tokens", "lm_head") and "conv_weight" not in name \
                and "kv_b_proj" not in name:
            dense += p.numel()
    experts = (len(cfg.kda_layers + cfg.mla_layers) * cfg.num_experts_per_tok * 3 * cfg.moe_intermediate_size
               * cfg.hidden_size)
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
    ap.add_argument("--batches", help="decode batch sizes (default 1,32,128; smoke 1,4)")
    ap.add_argument("--context", type=int, help="decode context (default 4096; smoke 96)")
    ap.add_argument("--prefill", type=int, help="prefill tokens (default 8192; smoke 192)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hf-steps", type=int, default=8, help="timed transformers decode steps (anchor: 8)")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers; random release-format weights")
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU, to check the script")
    args = ap.parse_args()
    for name, full, smoke in (("batches", "1,32,128", "1,4"), ("context", 4096, 96), ("prefill", 8192, 192)):
        if getattr(args, name) is None:  # the interpreter runs the full sizes far too slowly
            setattr(args, name, smoke if args.smoke else full)
    global DEV
    DEV = "cpu" if args.smoke else "cuda"
    report = header()
    report["arguments"] = vars(args)  # the defaults the command left out included
    if DEV != "cuda":
        report["device"] += " (smoke)"
    out = Path(args.out)

    def save():
        write_results(out.stem, report, directory=out.parent)

    report["ceilings"] = ceil = ceilings.measure(DEV, quick=args.smoke)
    if "matmul_flops_per_s_bfloat16" not in ceil:
        ceil["matmul_flops_per_s_bfloat16"] = ceil["matmul_flops_per_s"]
    save()
    cfg = slice_config(args.smoke)
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter's bf16 matrix product is not exact
    hf_runs = SMOKE_HF_RUNS if args.smoke else HF_RUNS
    free_memory()
    state_dict = None
    if not args.no_transformers:
        hf = build_hf(cfg, dtype, DEV)
        report["transformers"] = measure_hf(hf, hf_runs, args.hf_steps, DEV)
        report["transformers"]["memory"] = gpu_gb()
        save()
        state_dict = hf.state_dict()
    free_memory()
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()  # from here the peak is both models at once
    t = time.perf_counter()
    if state_dict is None:
        source, lm = "random release-format tensors", random_model(cfg, dtype, DEV)
    else:
        source = "transformers Glm5NextTextModel random init"
        lm = load_model_from_state_dict(cfg, state_dict, dtype, DEV, path="random-slice")
    sync()
    report["load"] = dict(source=source, tensors=lm.report.loaded, seconds=time.perf_counter() - t, **gpu_gb())
    del state_dict
    if not args.no_transformers:
        del hf
    free_memory()
    report["load"]["after_free"] = gpu_gb()
    print("load", report["load"], flush=True)
    save()
    report["logits_vs_reference"] = logits_check(lm)
    print("logits", report["logits_vs_reference"], flush=True)
    save()
    def compare():  # after each part, so a run cut short still reports what it can compare
        if "transformers" in report:
            report["speedup_vs_transformers"] = speedups(report["transformers"], report["decode"],
                                                         report.get("decode_at_transformers_context", []),
                                                         report.get("prefill_at_transformers_length"))
        save()

    report["decode"] = []
    for b in (int(x) for x in args.batches.split(",")):
        report["decode"].append(decode(lm, b, args.context, args.steps, ceil))
        free_memory()  # the step's cache and graphs
        print("decode", report["decode"][-1], flush=True)
        compare()
    report["prefill"] = prefill(lm, args.prefill, 3, ceil)
    print("prefill", report["prefill"], flush=True)
    save()
    if args.no_transformers:
        return
    report["decode_at_transformers_context"] = []
    for B, P in hf_runs:
        report["decode_at_transformers_context"].append(decode(lm, B, P, args.steps, ceil))
        free_memory()
        print("decode at transformers' context", report["decode_at_transformers_context"][-1], flush=True)
        compare()
    report["prefill_at_transformers_length"] = prefill(lm, hf_runs[0][1], 3, ceil)
    compare()
    print("speed-up vs transformers", report["speedup_vs_transformers"], flush=True)

if __name__ == "__main__":
    main()
