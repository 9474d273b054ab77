"""The decode all-reduce: NCCL against a one-shot all-reduce over NVLink peer memory, eager and in CUDA graphs.

A decode step of a tensor-parallel model sums each layer's partial outputs twice (attention o_proj, MoE
combine): one token's hidden state is 12 KB in bf16, far below the size where bandwidth matters, so the
step pays two collective latencies per layer. A one-shot all-reduce reads every peer's buffer directly
over NVLink (each rank loads the others' inputs and sums them: one kernel, one barrier); PyTorch's
symmetric memory provides it (``torch.ops.symm_mem.one_shot_all_reduce``, and the two-shot variant that
reduce-scatters then all-gathers). Neither uses NVLink multicast: the script refuses to run unless
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NCCL_NVLS_ENABLE=0`` are set (a multicast program can take the
host's GPUs out of service).

Per message size (one token, 8, 64 and 1024 tokens of a 6144-wide bf16 hidden state) and method: microseconds
per call eager and replayed from a CUDA graph (median over ranks' medians), the result against NCCL's
(relative error), and the ratio to NCCL in the same run. The floor of a one-shot call is the read of
``(world - 1) x bytes`` from the peers at the measured NCCL bus bandwidth of the largest message, plus one
barrier: at these sizes the latency term dominates, which is why the graph numbers are the ones to compare.

usage: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/allreduce.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from flashinfra.feedback.timing import header, relerr, time_eager, time_graph, write_results

HIDDEN = 6144
TOKENS = (1, 8, 64, 1024)


def _peer_methods(group_name: str, x: torch.Tensor):
    """The symmetric-memory all-reduces over a buffer of ``x``'s shape; {} where this torch lacks them."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(buf, group=group_name)
    except (ImportError, RuntimeError, AttributeError) as e:
        print(f"symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
        return {}
    buf.copy_(x)
    ops = torch.ops.symm_mem
    return {
        "peer_one_shot": lambda: ops.one_shot_all_reduce(buf, "sum", group_name),
        "peer_two_shot": lambda: ops.two_shot_all_reduce_(buf.copy_(x), "sum", group_name),
    }


def measure(tokens: int, group_name: str, rank: int, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g, device=device).to(torch.bfloat16)
    want = x.float().clone()
    dist.all_reduce(want)
    nccl_buf = x.clone()
    methods = {"nccl": lambda: dist.all_reduce(nccl_buf.copy_(x)) or nccl_buf, **_peer_methods(group_name, x)}
    row: dict = {"bytes": x.numel() * x.element_size()}
    for name, fn in methods.items():
        got = fn()
        torch.cuda.synchronize()
        row[name] = {"relerr_vs_fp32_sum": relerr(got.float(), want),
                     "eager_us": time_eager(fn, iters=50, device="cuda"),
                     "graph_us": time_graph(fn, replays=20, iters=20)}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="also copy the JSON into this folder")
    args = p.parse_args()
    for var, value in (("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NCCL_NVLS_ENABLE", "0")):
        if os.environ.get(var) != value:
            raise SystemExit(f"set {var}={value}: NVLink multicast must stay off")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    group_name = dist.group.WORLD.group_name
    rows = {}
    for tokens in TOKENS:
        row = measure(tokens, group_name, rank, device)
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        merged = {"bytes": row["bytes"]}
        for name in row:
            if name != "bytes":
                merged[name] = {k: statistics.median(r[name][k] for r in gathered) for k in row[name]}
        for name in merged:
            if name not in ("bytes", "nccl"):
                for mode in ("eager_us", "graph_us"):
                    merged[name][f"{mode[:-3]}_ratio_to_nccl"] = merged["nccl"][mode] / merged[name][mode]
        rows[f"tokens_{tokens}"] = merged
    if rank == 0:
        big = rows[f"tokens_{TOKENS[-1]}"]
        busbw = 2 * (world - 1) / world * big["bytes"] / (big["nccl"]["graph_us"] * 1e-6)  # bytes/s
        for row in rows.values():
            row["one_shot_floor_us"] = (world - 1) * row["bytes"] / busbw * 1e6
        results = {**header(), "world": world, "hidden": HIDDEN, "nccl_busbw_GBps_largest": busbw / 1e9,
                   "anchor": "../shared/anchors/h200x2-nccl-2026-12-04.json: allreduce_12288_graph_us 10.37", **rows}
        write_results(f"allreduce_x{world}", results, copy_to=args.out)
        print(f"{'tokens':>7} {'bytes':>9} " + " ".join(f"{m + ' graph us':>22}" for m in rows["tokens_1"]
                                                       if m not in ("bytes", "one_shot_floor_us")))
        for name, row in rows.items():
            print(f"{name[7:]:>7} {row['bytes']:>9} " + " ".join(
                f"{row[m]['graph_us']:>22.2f}" for m in row if m not in ("bytes", "one_shot_floor_us")))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
