"""Host time of one KDA prefill call (v3, T=8192, H=64, K=V=128, bf16): what the Python side costs per call, apart
from the GPU's work. ``enqueue_us``: calls queued back to back while the GPU is busy with the earlier ones (no
synchronisation inside), per call; ``from_idle_us``: one call's host time with the GPU idle, median of 20; then a
cProfile of 20 calls, the functions by their own time and by cumulative time.

    python bench/kda_prefill_host.py [--out DIR]  -> bench/results/kda_prefill_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import header, write_results  # noqa: E402
from kda_prefill import inputs  # noqa: E402

from flashinfra.kernels.kda_prefill import kda_prefill_launch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also copy the JSON into this folder")
    args = ap.parse_args()
    a = inputs([8192], seed=1)
    call_args = (a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"], [0], [True])
    for _ in range(3):
        kda_prefill_launch(*call_args)
    torch.cuda.synchronize()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        kda_prefill_launch(*call_args)
    enqueue = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()

    def from_idle() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kda_prefill_launch(*call_args)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e6

    idle = statistics.median(from_idle() for _ in range(20))
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        kda_prefill_launch(*call_args)
    prof.disable()
    torch.cuda.synchronize()
    res = header() | {"enqueue_us": enqueue, "from_idle_us": idle, "profile": {}}
    for order in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(18)
        res["profile"][order] = text.getvalue()
    print(f"enqueue per call (GPU busy) {enqueue:.1f} us; host time of a call from idle, median {idle:.1f} us")
    print(res["profile"]["tottime"])
    write_results("kda_prefill_host", res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
