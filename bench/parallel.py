"""Tensor/expert parallel cost on the 4-layer full-width slice (``hotpath_slice.py``'s config, random bf16
weights): decode steps (batch 1 and 32, ``--context`` cached tokens, eager and CUDA-graph replay) and a
``--prefill``-token prefill, per configuration:

- ``single``: the model without torch.distributed (what the engine runs at world size 1);
- ``nccl1``: world size 1 over NCCL through the parallel path (``init_distributed``, ``make_comms``,
  ``shard_loaded``), which must hand back the plain model itself (checked): no hooks, no collectives, no
  copies, so its times equal ``single``'s within the noise;
- under ``torchrun --nproc-per-node N``: TP=N with ``ep=1`` and ``ep=N``, the collectives counted per step.

Every rank builds the same random weights (same seed) and slices them (``shard_loaded``); rank 0 writes
the JSON (device, command, date) to ``bench/results/parallel[_tpN].json``.

usage: python bench/parallel.py                        # single and nccl1 on one GPU
       torchrun --nproc-per-node 8 bench/parallel.py   # TP=8 / EP=8 on one host
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hotpath_slice import fill_cache, slice_config  # noqa: E402

from flashinfra.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from flashinfra.feedback.timing import call_times_us, header, write_results  # noqa: E402
from flashinfra.model.api import random_model  # noqa: E402
from flashinfra.model.forward_batch import ForwardBatch  # noqa: E402
from flashinfra.parallel.groups import init_distributed, make_comms  # noqa: E402
from flashinfra.parallel.layout import make_layout  # noqa: E402
from flashinfra.parallel.shard import shard_loaded  # noqa: E402

BS = 64


def build(cfg: dict, kind: str, tp: int, ep: int, rank: int):
    model = random_model(cfg, "bfloat16", "cuda")
    if kind == "single":
        return model, None
    layout = make_layout(model.config.text, tp, ep, rank)
    comms = make_comms(layout)
    sharded = shard_loaded(model, layout, comms)
    if layout.world == 1:
        assert sharded is model, "world size 1 must run the plain model"
    return sharded, comms


def measure(model, comm, args) -> dict:
    out = {}
    for batch_size in (1, 32):
        blocks = -(-(args.context + 1) // BS)
        cache = model.allocate_cache(batch_size * blocks + 1, BS, batch_size + 1)
        fill_cache(cache)
        tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(batch_size)]
        batch = ForwardBatch.build([1] * batch_size, [args.context] * batch_size, list(range(batch_size)), tables,
                                   BS, "cuda")
        ids = torch.randint(0, 1000, (batch_size,), device="cuda")
        eager = call_times_us(lambda: model.forward(ids, batch, cache), iters=args.steps, device="cuda")
        graphs = DecodeGraphs(model, cache, batch_size * blocks, batch_size)
        replay = call_times_us(lambda: graphs.run(ids, batch), iters=args.steps, device="cuda")
        calls = comm.calls if comm else 0
        model.forward(ids, batch, cache)
        out[f"decode_b{batch_size}"] = dict(eager_us=statistics.median(eager), graph_us=statistics.median(replay),
                                            collectives_per_step=(comm.calls - calls) if comm else 0)
        del cache, graphs
    n = args.prefill
    cache = model.allocate_cache(-(-n // BS) + 1, BS, 2)
    batch = ForwardBatch.build([n], [0], [0], [list(range(-(-n // BS)))], BS, "cuda")
    ids = torch.randint(0, 1000, (n,), device="cuda")
    out["prefill_us"] = statistics.median(call_times_us(lambda: model.forward(ids, batch, cache), iters=3,
                                                        warmup=1, device="cuda"))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_distributed(rank, world, f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    cfg = slice_config(smoke=False)
    results = header()
    runs = [("single", 1, 1), ("nccl1", 1, 1)] if world == 1 else [(f"tp{world}", world, 1),
                                                                    (f"tp{world}_ep{world}", world, world)]
    for name, tp, ep in runs:
        model, comm = build(cfg, "single" if name == "single" else "sharded", tp, ep, rank)
        results[name] = measure(model, comm, args)
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        write_results("parallel" if world == 1 else f"parallel_tp{world}", results)
        print(results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
