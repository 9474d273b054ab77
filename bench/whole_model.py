"""The whole GLM-5.3-Flash (45 layers at full width, random weights drawn on the GPUs, no download) served over
``--gpus`` ranks in FP8 or W8A8: load time, memory per GPU, cache tokens that fit, and ``flashinfra bench serve`` at
each ``--concurrency`` with ``--input-len``-token prompts and ``--output-len`` outputs (token ids, ignore_eos).

Steps: ``flashinfra plan`` sizes the layout and writes a model directory (config and the built-in tokenizer);
``flashinfra serve --load-format random`` starts one rank per GPU, each drawing, quantizing and slicing only its
shard (``flashinfra.parallel.load.random_shard``); the ranks' reports (load seconds, weight and device bytes) and
the cache size are read from the server's log. Writes ``bench/results/whole_model_<dtype>_<gpus>gpu.json``.

usage: python bench/whole_model.py --gpus 8 --dtype fp8          # nvidia-h200-x8 (x4: --gpus 4)
       python bench/whole_model.py --smoke                       # the same path on the CPU: tiny model, gloo
The MTP block is not loaded (``--load-format random`` draws the trunk), so speculation is not measured here.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_runs import bench, log_tail, running, sweep  # noqa: E402

from flashinfra.feedback.timing import header, write_results  # noqa: E402
from flashinfra.model.factory import TINY_TEXT_CONFIG  # noqa: E402
from flashinfra.parallel.plan import GLM_5_3_FLASH, plan, write_model_dir  # noqa: E402

PLAN_DTYPE = {"fp8": "fp8", "w8a8": "int8"}
RANK_LINE = re.compile(r"flashinfra rank (\d+): ([\d.]+) GiB of weights \((\w+)\) loaded in ([\d.]+) s"
                       r"(?:, ([\d.]+) GiB allocated)?")
CACHE_LINE = re.compile(r"flashinfra: (\d+) cache blocks of (\d+) tokens")
SMOKE = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
         "text_config": {**TINY_TEXT_CONFIG, "model_type": "glm5_next_text", "vocab_size": 4096, "linear_head_dim": 64,
                         "qk_nope_head_dim": 64, "v_head_dim": 64, "intermediate_size": 256,
                         "moe_intermediate_size": 256}}


def serve_command(args, model_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "flashinfra", "serve", "--model", str(model_dir), "--load-format", "random",
           "--quantization", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype, "--tensor-parallel-size",
           str(args.gpus), "--expert-parallel-size", str(args.gpus), "--max-num-seqs", str(max(args.concurrency)),
           "--max-model-len", str(args.input_len + args.output_len + 64), "--port", str(args.port),
           "--dist-timeout-s", "1800"]
    if args.smoke:
        cmd += ["--device", "cpu", "--dtype", "float32", "--num-blocks", "256"]
    return cmd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(PLAN_DTYPE), default="fp8", help="weights (--quantization)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "int8"), default="fp8")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--prompts-per-slot", type=int, default=2, help="requests per concurrency slot (at least 4)")
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/flashinfra-glm53-random"))
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 CPU ranks over gloo, short requests")
    p.add_argument("--out", default=None, help="also copy the JSON into this folder")
    args = p.parse_args()
    if args.smoke:
        args.gpus, args.input_len, args.output_len, args.concurrency = 2, 24, 4, [1, 2]
    raw = SMOKE if args.smoke else GLM_5_3_FLASH
    results = header()
    sizing = plan(raw, args.gpus, weight_dtype=PLAN_DTYPE[args.dtype], kv_cache_dtype=args.kv_cache_dtype,
                  max_num_seqs=max(args.concurrency))
    results["plan"] = asdict(sizing)
    model_dir = write_model_dir(raw, args.model_dir)
    cmd = serve_command(args, model_dir)
    results["serve_command"] = " ".join(cmd[1:])
    log_path = model_dir / "serve.log"
    with running(cmd, args.port, log_path, timeout_s=1800.0, stop_timeout_s=120.0) as startup_s:
        results["startup_s"] = startup_s
        text = log_path.read_text(encoding="utf-8", errors="replace")
        results["ranks"] = {int(m[1]): dict(weight_gib=float(m[2]), weights=m[3], load_s=float(m[4]),
                                            device_allocated_gib=float(m[5]) if m[5] else None)
                            for m in RANK_LINE.finditer(text)}
        if cache := CACHE_LINE.search(text):
            results["cache_tokens_per_rank"] = int(cache[1]) * int(cache[2])
        # untimed: the first requests of a fresh server
        bench(args.port, 1, 2, args.input_len, args.output_len, timeout_s=3600.0)
        results["serve"] = sweep(args.port, args.concurrency, lambda c: max(4, args.prompts_per_slot * c),
                                 args.input_len, args.output_len, timeout_s=3600.0)
    results["log_tail"] = log_tail(log_path)
    name = "whole_model_smoke" if args.smoke else f"whole_model_{args.dtype}_{args.gpus}gpu"
    print(write_results(name, results, args.out))


if __name__ == "__main__":
    main()
