"""MoE token dispatch and combine over ``world`` ranks: all-to-all against all-gather + reduce-scatter, with
the all-reduce that this engine's layout uses beside them.

The three schemes move one MoE layer's hidden states ``[T, D]`` (``D`` = 4096, top-``k`` = 8 experts per
token, routing taken as uniform: every rank receives the same number of pairs):

- ``all_to_all``: tokens split by rank (``T / world`` each, data-parallel attention or sequence parallel);
  dispatch sends each token's ``k`` pairs to the ranks of their experts (``T * k / world`` rows out of each
  rank), combine returns them (the same again); one ``all_to_all_single`` each way.
- ``allgather_reducescatter``: tokens split by rank; dispatch all-gathers every token to every rank
  (``[T / world, D]`` -> ``[T, D]``), combine reduce-scatters the partial sums back (``[T, D]`` ->
  ``[T / world, D]``).
- ``all_reduce``: tokens replicated on every rank (``shard.py``'s layout): dispatch is free, combine is
  one all-reduce of ``[T, D]``.

Each time is the slowest rank's median over ``--iters`` (eager: launches included). Rank 0 writes
``bench/results/parallel_moe_dispatch_w{world}[_cpu].json`` with the device, command and date, and for each
token count the faster of the two split-token schemes (``choice``): the table a layout with split tokens
would choose from. The rule ``shard.py`` states (all-reduce while tokens are replicated) is what this
engine does today.

usage: torchrun --nproc-per-node 8 bench/parallel_moe_dispatch.py     # NCCL, one host (2, 4 or 8 GPUs)
       python bench/parallel_moe_dispatch.py --cpu --world 2          # gloo smoke check on the CPU
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashinfra.feedback.timing import header, write_results  # noqa: E402

HIDDEN, TOPK = 4096, 8
TOKENS = (8, 32, 128, 512, 2048, 8192)  # decode batches to prefill chunks
CPU_TOKENS = (8, 64)


def _time_us(fn, iters: int, device: str) -> float:
    """The slowest rank's median microseconds of ``fn`` (every rank starts each call together)."""
    cuda = device.startswith("cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def measure(world: int, tokens: tuple[int, ...], iters: int, device: str, dtype: torch.dtype) -> dict:
    rows = {}
    for T in tokens:
        T = -(-T // world) * world  # whole tokens per rank
        local = T // world
        pairs = -(-local * TOPK // world) * world  # pairs each rank sends, evenly over the ranks
        x_local = torch.randn(local, HIDDEN, device=device, dtype=dtype)
        x_full = torch.randn(T, HIDDEN, device=device, dtype=dtype)
        send = torch.randn(pairs, HIDDEN, device=device, dtype=dtype)
        recv = torch.empty_like(send)

        def all_to_all():
            dist.all_to_all_single(recv, send)  # dispatch
            dist.all_to_all_single(send, recv)  # combine

        def allgather_reducescatter():
            dist.all_gather_into_tensor(x_full, x_local)
            dist.reduce_scatter_tensor(x_local, x_full)

        def all_reduce():
            dist.all_reduce(x_full)

        row = {name: _time_us(fn, iters, device) for name, fn in (("all_to_all", all_to_all),
                                                                 ("allgather_reducescatter", allgather_reducescatter),
                                                                 ("all_reduce", all_reduce))}
        row["choice"] = min(("all_to_all", "allgather_reducescatter"), key=row.get)
        row["bytes_per_rank"] = {"all_to_all": 2 * pairs * HIDDEN * x_full.element_size(),
                                 "allgather_reducescatter": 2 * T * HIDDEN * x_full.element_size(),
                                 "all_reduce": 2 * T * HIDDEN * x_full.element_size()}
        rows[str(T)] = row
    return rows


def _rank(rank: int, world: int, port: int, args) -> None:
    cpu = args.cpu
    device = "cpu" if cpu else f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
    if not cpu:
        torch.cuda.set_device(device)
    init = f"tcp://127.0.0.1:{port}" if cpu else "env://"
    dist.init_process_group("gloo" if cpu else "nccl", init_method=init, rank=rank, world_size=world)
    results = header()
    results.update(world=world, hidden=HIDDEN, topk=TOPK, backend=dist.get_backend(),
                   tokens=measure(world, CPU_TOKENS if cpu else TOKENS, args.iters, device,
                                  torch.float32 if cpu else torch.bfloat16))
    if rank == 0:
        path = write_results(f"parallel_moe_dispatch_w{world}" + ("_cpu" if cpu else ""), results,
                             directory=args.out)
        print(path)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (a smoke check; spawns --world ranks)")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn with --cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None, help="results folder (default: bench/results)")
    args = p.parse_args()
    if not args.cpu:
        _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(args.world, port, args), nprocs=args.world, join=True, start_method="fork")


if __name__ == "__main__":
    main()
