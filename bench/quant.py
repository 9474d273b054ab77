"""8-bit weights and caches against bf16, in one run: accuracy, cache capacity, and speed.

Modes (``MODES``): bf16; W8A8 INT8 weights; block-FP8 weights; an fp8 / int8 MLA latent cache; W8A8 with an int8
cache; a bf16 KDA state (every KDA kernel reads and stores a bf16 state).

1. accuracy, on the built-in default model (bf16 on the GPU; float32 on the CPU for ``--smoke``): perplexity on
   held-out text (``--text``, default ``tests/eval/data/heldout-slice.txt``; the README's 30,747-token
   ``heldout-sample.txt`` is made by ``train/data.py`` and is the better choice where it exists), the greedy tokens
   of ``--greedy`` steps from held-out prompts compared position by position with bf16's, and per layer the
   relative difference of each decoder layer's output streams from bf16's (``layerwise``; differences accumulate
   through the layers, they are not isolated per layer). Goals: perplexity within 1 % of bf16 (W8A8), 0.5 % (fp8
   cache), 1 % (int8 cache).
2. memory: cache tokens per GiB at the released model's sizes for each ``--kv-cache-dtype`` x KDA state dtype
   (goal: >= 1.9x bf16 for the latent).
3. speed (GPU; toy sizes on the CPU references for ``--smoke``): the int8 / fp8 / bf16 tensor-core peaks measured
   here (square 8192 products through torch), the slice's dense projections and its 288-expert MoE at 1, 32, 128
   and 8192 tokens for each weight format (TFLOP/s and the fraction of that format's peak), the RMSNorm and the
   projection it feeds at the same token counts (``norm_gemms``: bf16; W8A8 with the activation quantization a
   kernel of its own; W8A8 with it in the norm's epilogue, as the model runs it), and on the 4-layer
   full-width slice (3 KDA + 1 MLA/DSA, every MLP a MoE, its own lm_head as the model has, random weights)
   decode steps at batch 1 / 32 / 128 with ``--context`` cached tokens (CUDA-graph replay, eager where capture
   fails; steps back to back as the engine's asynchronous scheduling runs them, and ``_synced_ms`` each alone) and a ``--prefill``-token prefill per mode, each against bf16 (goals: decode <= 0.6x bf16's time at
   batch 1, prefill >= 1.5x bf16's speed), and per layer the slice's output streams on a 256-token prompt against
   bf16's (``layerwise_rel``).

The kernel part (3's peaks, projections, MoE and norm + projection) is ``bench/quant_kernels.py``.

usage: python bench/quant.py --out bench/results/quant.json [--smoke]
       (--smoke: python bench/quant.py --smoke --out bench/results/quant_smoke.json, a few minutes on a CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from quant_kernels import free, gemms, median_s, moes, norm_gemms, peaks

from flashinfra.config import resolve_config
from flashinfra.eval.perplexity import perplexity
from flashinfra.feedback.timing import time_stream
from flashinfra.model.api import load_model, model_config_from, random_model
from flashinfra.model.factory import default_model_dir
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.quant.cache import KV_CACHE_DTYPES, STATE_DTYPES, CacheDtypeError, CacheSpec, tokens_per_gib
from flashinfra.quant.model import QuantizationError

ROOT = Path(__file__).resolve().parents[1]
MODES = {  # name -> (--quantization, --kv-cache-dtype, --kda-state-dtype)
    "bf16": ("none", "auto", "float32"),
    "w8a8": ("w8a8", "auto", "float32"),
    "fp8": ("fp8", "auto", "float32"),
    "kv_fp8": ("none", "fp8", "float32"),
    "kv_int8": ("none", "int8", "float32"),
    "w8a8_kv_int8": ("w8a8", "int8", "float32"),
    "kda_state_bf16": ("none", "auto", "bfloat16"),
}
PPL_GOALS = {"w8a8": 0.01, "kv_fp8": 0.005, "kv_int8": 0.01}
SLICE_MODES = ("bf16", "w8a8", "fp8", "w8a8_kv_int8")
SMOKE_SLICE = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                   vocab_size=1000, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                   qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=16,
                   linear_head_dim=16, linear_num_heads=4, pad_token_id=0)


def spec_of(mode: str) -> tuple[str, CacheSpec]:
    q, kv, state = MODES[mode]
    return q, CacheSpec.from_flags(kv, state)


# ---- 1. accuracy --------------------------------------------------------------------------------------------------

def greedy(model, prompts: list[list[int]], steps: int, bs: int = 16) -> list[list[int]]:
    """Greedy continuation of every prompt (one packed prefill, then batched decode steps)."""
    dev = model.device
    need = [-(-(len(p) + steps) // bs) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(prompts))]
    cache = model.allocate_cache(sum(need), bs, len(prompts))
    slots = list(range(len(prompts)))
    batch = ForwardBatch.build([len(p) for p in prompts], [0] * len(prompts), slots, tables, bs, dev)
    hidden = model.forward(torch.tensor([t for p in prompts for t in p], device=dev), batch, cache)
    tok = model.compute_logits(hidden[torch.tensor(batch.last_token_indices, device=dev)]).argmax(-1)
    out = [tok]
    for i in range(steps - 1):
        batch = ForwardBatch.build([1] * len(prompts), [len(p) + i for p in prompts], slots, tables, bs, dev)
        tok = model.compute_logits(model.forward(tok, batch, cache)).argmax(-1)
        out.append(tok)
    return torch.stack(out, 1).tolist()


def layer_outputs(model, prompt: list[int]) -> list[torch.Tensor]:
    """Every decoder layer's output streams for one prefill of ``prompt``."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, a, out: seen.append(out.float().cpu()))
             for layer in model.model.layers]
    try:
        model.logits([prompt])
    finally:
        for h in hooks:
            h.remove()
    return seen


def accuracy(dev: str, dtype: str, ids: list[int], greedy_steps: int, window: int) -> dict:
    step = len(ids) // 4
    prompts = [ids[i * step: i * step + min(32, step)] for i in range(4)]  # four held-out prompts
    out, base = {}, None
    for mode in MODES:
        q, spec = spec_of(mode)
        try:
            model = load_model(default_model_dir(), dtype=dtype, device=dev, quantization=q, cache_spec=spec)
        except (QuantizationError, CacheDtypeError) as e:
            out[mode] = {"refused": str(e)}
            continue
        row = {"perplexity": perplexity(model, ids, window=window).perplexity,
               "greedy": greedy(model, prompts, greedy_steps), "layers": layer_outputs(model, ids[:window])}
        del model
        free()
        if base is None:
            base = row
        res = {"perplexity": row["perplexity"], "perplexity_vs_bf16": row["perplexity"] / base["perplexity"] - 1}
        same = [sum(a == b for a, b in zip(x, y)) / len(y) for x, y in zip(row["greedy"], base["greedy"])]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                 for x, y in zip(row["greedy"], base["greedy"])]
        res.update(greedy_agreement=sum(same) / len(same), greedy_first_divergence=first,
                   layerwise_rel=[float((a - b).norm() / b.norm()) for a, b in zip(row["layers"], base["layers"])])
        if mode in PPL_GOALS:
            res["goal_perplexity_within"] = PPL_GOALS[mode]
            res["goal_met"] = abs(res["perplexity_vs_bf16"]) <= PPL_GOALS[mode]
        out[mode] = res
    return out


# ---- 2. memory ----------------------------------------------------------------------------------------------------

def memory() -> dict:
    cfg = resolve_config({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                          "text_config": {"model_type": "glm5_next_text", "index_kpool": 4}}).text
    out = {}
    base = tokens_per_gib(cfg, CacheSpec("bfloat16"), torch.bfloat16)["latent_tokens_per_gib"]
    for kv in KV_CACHE_DTYPES[1:]:
        for state in STATE_DTYPES:
            r = tokens_per_gib(cfg, CacheSpec(kv, state), torch.bfloat16)
            r["latent_vs_bf16"] = r["latent_tokens_per_gib"] / base
            r["goal_met"] = kv == "bfloat16" or r["latent_vs_bf16"] >= 1.9
            out[f"{kv}/{state}"] = r
    return out


# ---- 3. speed -----------------------------------------------------------------------------------------------------

def slice_speed(dev: str, cfg: dict, batches: tuple[int, ...], context: int, prefill: int, reps: int) -> dict:
    from flashinfra.engine.cuda_graphs import DecodeGraphs

    dtype = "bfloat16" if dev == "cuda" else "float32"
    out, base_layers = {}, None
    vocab = model_config_from(cfg).text.vocab_size
    prompt = torch.randint(0, vocab, (256 if dev == "cuda" else 16,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    for mode in SLICE_MODES:
        q, spec = spec_of(mode)
        try:  # the same seeded weights each time, made tensor by tensor (peak memory: the model's)
            model = random_model(cfg, dtype, dev, quantization=q, cache_spec=spec)
        except (QuantizationError, CacheDtypeError) as e:
            out[mode] = {"refused": str(e)}
            continue
        finally:
            free()
        bs = 64 if dev == "cuda" else 16
        row = {}
        layers = layer_outputs(model, prompt)  # layerwise: each layer's output streams against bf16's
        base_layers = base_layers or layers
        row["layerwise_rel"] = [float((a - b).norm() / b.norm()) for a, b in zip(layers, base_layers)]
        del layers
        per_seq = -(-(context + 1) // bs)
        B = max(batches)
        cache = model.allocate_cache(B * per_seq + 1, bs, B + 1)
        for b in batches:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            batch = ForwardBatch.build([1] * b, [context] * b, list(range(b)), tables, bs, model.device)
            ids = torch.randint(0, model.config.text.vocab_size, (b,), device=dev)
            how = "eager"
            # a step as the engine runs it: the layers (from a CUDA graph where there is one), then the logits
            fn = lambda: model.compute_logits(model.forward(ids, batch, cache))  # noqa: E731
            if dev == "cuda":
                try:
                    graphs = DecodeGraphs(model, cache, B * per_seq, B)
                    graphs.run(ids, batch)
                    fn, how = (lambda: model.compute_logits(graphs.run(ids, batch))), "cuda_graph+logits"
                except Exception as e:  # noqa: BLE001 - recorded, eager timing instead
                    row[f"decode_b{b}_graph_error"] = repr(e)[:300]
            # steps queued back to back, as the engine's asynchronous scheduling runs them (a step's host work
            # overlaps the one before); and each step synchronized alone, its host work in the time
            row[f"decode_b{b}_ms"] = time_stream(fn, calls=10, iters=max(3, reps // 5), device=dev) / 1e3
            row[f"decode_b{b}_synced_ms"] = median_s(fn, dev, reps) * 1e3
            row[f"decode_b{b}_how"] = how
        del cache, fn
        graphs = None  # it holds the model and the cache: else this mode's model lives on beside the next one's
        free()
        pcache = model.allocate_cache(-(-prefill // bs), bs, 1)
        batch = ForwardBatch.build([prefill], [0], [0], [list(range(-(-prefill // bs)))], bs, model.device)
        ids = torch.randint(0, model.config.text.vocab_size, (prefill,), device=dev)
        row["prefill_ms"] = median_s(lambda: model.forward(ids, batch, pcache), dev, max(1, reps // 4), warmup=1) * 1e3
        if dev == "cuda":
            row["gpu_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        del model, pcache
        free()
        out[mode] = row
    base = out.get("bf16", {})
    for mode, row in out.items():
        if mode == "bf16" or "refused" in row:
            continue
        for b in batches:
            row[f"decode_b{b}_vs_bf16"] = row[f"decode_b{b}_ms"] / base[f"decode_b{b}_ms"]
        row["prefill_speedup_vs_bf16"] = base["prefill_ms"] / row["prefill_ms"]
        row["goals"] = {"decode_b1_at_most_0.6x_bf16": row[f"decode_b{batches[0]}_vs_bf16"] <= 0.6,
                        "prefill_at_least_1.5x_bf16": row["prefill_speedup_vs_bf16"] >= 1.5}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench/results/quant.json"))
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU references (checks the script)")
    p.add_argument("--text", default=str(ROOT / "tests/eval/data/heldout-slice.txt"))
    p.add_argument("--greedy", type=int, default=256)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--parts", default="accuracy,kernels,slice",
                   help="comma-separated subset of accuracy,kernels,slice; a subset updates those parts of --out")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    from tokenizers import Tokenizer

    dev = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    smoke = args.smoke or dev == "cpu"
    ids = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")).encode(
        Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False).ids
    result = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (references)", "smoke": smoke,
              "dtype": "bfloat16" if dev == "cuda" else "float32 (the 'bf16' mode is the float32 baseline)",
              "text": {"file": args.text, "tokens": len(ids)}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if parts != {"accuracy", "kernels", "slice"} and out.is_file():  # keep the other parts' last figures
        result = {**json.loads(out.read_text()), **result, "parts_run": sorted(parts)}
    # where and when each part's figures were measured (a subset run keeps the other parts' own)
    result["runs"] = {**result.get("runs", {}),
                      **{part: {k: result[k] for k in ("device", "date", "command")} for part in sorted(parts)}}

    def save():
        out.write_text(json.dumps(result, indent=1))

    result["memory"] = memory()
    save()
    if "accuracy" in parts:
        result["accuracy"] = accuracy(dev, "bfloat16" if dev == "cuda" else "float32", ids,
                                      16 if smoke else args.greedy, 128 if smoke else 256)
        save()
    # the slice as the model is served: its own lm_head (GLM-5.3-Flash's is untied), which W8A8 quantizes
    slice_cfg = dict(architectures=["Glm5NextForConditionalGeneration"], tie_word_embeddings=False,
                     text_config=dict(num_hidden_layers=4, mlp_layer_types=["sparse"] * 4, index_kpool=4,
                                      **(SMOKE_SLICE if smoke else {})))
    text_cfg = model_config_from(slice_cfg).text
    reps = 2 if smoke else args.reps
    tokens = (1, 32) if smoke else (1, 32, 128, 8192)
    if "kernels" in parts:
        result["peak_tflops"] = peak = peaks(dev, 256 if smoke else 8192, reps)
        result["gemm"] = gemms(dev, text_cfg, tokens, peak, reps)
        save()
        result["norm_gemm"] = norm_gemms(dev, text_cfg, tokens, reps)
        save()
        result["moe"] = moes(dev, text_cfg, tokens, peak, reps)
        save()
        free()
    if "slice" in parts:
        result["slice"] = slice_speed(dev, slice_cfg, (1, 4) if smoke else (1, 32, 128),
                                      32 if smoke else args.context, 64 if smoke else args.prefill, reps)
        save()
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
