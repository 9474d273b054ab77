"""Speculative decoding with the MTP layer: TPOT per draft count and concurrency, acceptance per draft
position, and KDA state bytes per request under ReplaySSM against the copy-per-draft baseline.

For each ``--ks`` value (0 = no speculation) and each ``--concurrency``: ``flashinfra.LLM`` with
``speculative_tokens=k`` generates ``--max-tokens`` greedy tokens for that many prompts at once (random
tokens of ``--prompt-len``, or the token ids of ``--text`` split into prompts, for acceptance on real
text). TPOT = (time of the full generation - time of the same prompts with max_tokens=1) / (max_tokens - 1),
the median of ``--runs`` runs after a warm-up. Acceptance per position j = accepted drafts at position j /
drafts verified at position j (the engine's ``Speculator`` counters). State bytes: per request over all KDA
layers, ``replay_bytes_per_slot`` (checkpoint + conv window + ring of k + 1) against
``copy_bytes_per_slot`` (a state and conv window per verified token). Each row also counts the Triton compilations
after the engine's start-up, by kernel (a ``CompileWatch`` of the script's own, so the engine writes no runtime
events while it is timed): a specialisation the warm-up missed, paid in the untimed first generation (or, if a timed
run meets a new shape, in the figure).

The checkpoint needs an MTP layer (``layers.N.*``); the built-in default model has one. ``--smoke``
writes a tiny random checkpoint with one and runs CPU float32 at small sizes (the script's own test;
its timings mean nothing).

usage: python bench/speculative.py [--smoke] --model DIR [--device cuda] [--dtype bfloat16] [--ks 0 1 3 5]
                                   [--concurrency 1 16] [--prompt-len 1024] [--max-tokens 128] [--runs 3]
                                   [--out bench/results/speculative.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _prompts(args, n: int, vocab: int, tokenizer=None) -> list[list[int]]:
    if args.text:
        ids = tokenizer.encode(Path(args.text).read_text()).ids
        step = max(1, len(ids) // n)
        return [ids[i * step : i * step + args.prompt_len] for i in range(n)]
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(n)]


def _timed(llm, prompts, params, runs: int) -> float:
    from flashinfra.feedback.timing import generated

    generated(llm, prompts, params)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        generated(llm, prompts, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run(args) -> dict:
    from flashinfra import LLM, SamplingParams
    from flashinfra.feedback.compiles import CompileWatch, KeptCompiles
    from flashinfra.model.replay import copy_bytes_per_slot, replay_bytes_per_slot

    rows = []
    for c in args.concurrency:
        for k in args.ks:
            llm = LLM(args.model, device=args.device, dtype=args.dtype, speculative_tokens=k,
                      speculative_max_batch=args.max_batch, max_num_seqs=max(c, 1),
                      **({"num_blocks": args.num_blocks} if args.num_blocks else {}))
            compiles = KeptCompiles()
            watch = CompileWatch(compiles).start() if args.device.startswith("cuda") else None
            text = llm.engine.model.config.text
            prompts = _prompts(args, c, text.vocab_size, llm.tokenizer)
            full = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True)
            first = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=True)
            t_full = _timed(llm, prompts, full, args.runs)
            t_first = _timed(llm, prompts, first, args.runs)
            if watch is not None:
                watch.stop()
            row = {"concurrency": c, "k": k, "max_batch": args.max_batch, "temperature": args.temperature,
                   "tpot_ms": 1e3 * (t_full - t_first) / (args.max_tokens - 1),
                   "generate_s": t_full, "prefill_s": t_first,
                   "startup_s": getattr(llm.engine.warmup, "seconds", None),
                   "compiles_after_startup": compiles.summary()}
            spec = llm.engine.runner.speculator
            if spec is not None:
                row["acceptance_per_position"] = [a / d if d else None
                                                  for a, d in zip(spec.num_accepted_at, spec.num_drafted_at)]
                row["mean_accepted_per_step"] = sum(spec.num_accepted_at) / max(1, spec.num_drafted_at[0])
                H, K, W = text.linear_num_heads, text.linear_head_dim, text.linear_conv_kernel_dim
                n = len(text.kda_layers)
                dt = llm.engine.model.dtype
                row["state_bytes_per_request"] = {"replay": n * replay_bytes_per_slot(H, K, K, W, k + 1, dt),
                                                  "copies": n * copy_bytes_per_slot(H, K, K, W, k + 1, dt)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["concurrency"]: r["tpot_ms"] for r in rows if r["k"] == 0}
    for r in rows:
        if r["concurrency"] in base:
            r["speedup_vs_k0"] = base[r["concurrency"]] / r["tpot_ms"] if r["tpot_ms"] > 0 else None
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    return {"device": device, "command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "smoke": args.smoke, "model": str(args.model), "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny random checkpoint with an MTP layer, CPU float32")
    p.add_argument("--model", help="checkpoint directory with an MTP layer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 5])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled rows (rejection sampling of drafts)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-batch", type=int, default=0,
                   help="--speculative-max-batch: draft only while at most this many requests decode (0: always)")
    p.add_argument("--text", help="a text file whose tokens make the prompts (acceptance on real text)")
    p.add_argument("--out", help="write the JSON result here")
    args = p.parse_args(argv)
    if args.smoke:
        from flashinfra.model.factory import write_tiny_checkpoint

        args.model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "mtp", seed=0, num_nextn_predict_layers=1))
        args.device, args.dtype, args.ks, args.concurrency = "cpu", "float32", [0, 1, 2], [1, 2]
        args.prompt_len, args.max_tokens, args.runs, args.num_blocks = 12, 6, 1, 64
    if not args.model:
        p.error("--model is required (a checkpoint with an MTP layer) unless --smoke")
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
