"""Structured-output cost: grammar-mask time per decode step at a batch size, and TPOT with and without a
JSON-schema grammar through the offline engine, each timed on its second run (the first compiles and captures what
the batch needs). Writes JSON with device, command and date.

The mask's two parts are timed apart, per step (medians): the fill (``GrammarRuntime.prepare`` until its
background fill ends: the matchers catch up and xgrammar fills the constrained rows' bitmask on the CPU) and the
apply (``GrammarMask.apply``: one copy to the device and one masking kernel, the device synchronized before and
after). Sampling the masked batch is timed on its own. In the engine the fill runs on its own thread while the
device runs the forward pass, so what it costs a step is what the TPOT ratio shows beyond the apply.

    python bench/structured_output.py --batch 64 --out bench/results/structured_output.json
    python bench/structured_output.py --batch 4 --steps 8 --max-tokens 16   # CPU smoke run, built-in model
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 8}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def mask_cost(model_dir, vocab_size: int, eos: list[int], batch: int, steps: int, device: str) -> dict:
    from flashinfra.engine.grammar import GrammarRuntime, fill_threads
    from flashinfra.engine.sampler import SamplingRow, sample
    from flashinfra.engine.sched.messages import GrammarSpec, SamplingParams

    runtime = GrammarRuntime.for_model(model_dir, vocab_size, eos, device)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(temperature=0.0, grammar=spec)
    outs = [[] for _ in range(batch)]
    g = torch.Generator(device=device).manual_seed(0)
    fill_s, apply_s, sample_s = [], [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=g, device=device)
        logits[:, eos] -= 100.0  # keep every row inside the grammar for the whole run
        masked = logits.clone()
        _sync(device)
        t0 = time.perf_counter()
        mask = runtime.prepare([(f"r{i}", spec, outs[i]) for i in range(batch)])
        mask.wait()
        t1 = time.perf_counter()
        mask.apply(masked)
        _sync(device)
        t2 = time.perf_counter()
        rows = [SamplingRow(params, [1], outs[i], None) for i in range(batch)]
        tokens, _, errors = sample(logits, rows, mask)  # masks its own copy of the logits again
        _sync(device)
        t3 = time.perf_counter()
        fill_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        sample_s.append(t3 - t2)
        for i, t in enumerate(tokens):
            if errors[i] is None and t not in eos:
                outs[i].append(t)
    return {"batch": batch, "steps": steps, "fill_threads": fill_threads(batch, runtime.words),
            "mask_fill_s_median": _median(fill_s), "mask_apply_s_median": _median(apply_s),
            "sample_with_mask_s_median": _median(sample_s)}


def tpot(llm, batch: int, max_tokens: int, grammar) -> dict:
    from flashinfra.engine.sched.messages import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=grammar is None, grammar=grammar)
    prompts = [f"Record {i}:" for i in range(batch)]
    llm.generate(prompts, params)  # warm up: the same batch, so every shape it meets is compiled and captured
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "tpot_s": elapsed / max(1, max(len(o.token_ids) for o in outs))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from flashinfra import LLM
    from flashinfra.engine.sched.messages import GrammarSpec

    llm = LLM(args.model, max_num_seqs=args.batch) if args.model else LLM(max_num_seqs=args.batch)
    model = llm.engine.model if hasattr(llm, "engine") else llm.core.model
    text = model.config.text
    device = str(model.device)
    result = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mask": mask_cost(model.path, text.vocab_size, list(text.eos_token_id), args.batch, args.steps, device),
        "tpot_free": tpot(llm, args.batch, args.max_tokens, None),
        "tpot_json_schema": tpot(llm, args.batch, args.max_tokens, GrammarSpec("json_schema", json.dumps(SCHEMA))),
    }
    free, constrained = result["tpot_free"]["tpot_s"], result["tpot_json_schema"]["tpot_s"]
    result["fill_share_of_step"] = result["mask"]["mask_fill_s_median"] / max(free, 1e-12)  # were it not overlapped
    result["apply_share_of_step"] = result["mask"]["mask_apply_s_median"] / max(free, 1e-12)
    result["tpot_json_schema_over_free"] = constrained / max(free, 1e-12)
    text_out = json.dumps(result, indent=2)
    print(text_out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text_out + "\n")


if __name__ == "__main__":
    main()
