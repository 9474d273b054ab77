"""Host time of one KDA prefill call (v3, T=8192, H=64, K=V=128, bf16): what the Python side costs per call, apart
from the GPU's work. ``enqueue_us``: calls queued back to back while the GPU is busy with the earlier ones (no
synchronisation inside), per call; ``from_idle_us``: one call's host time with the GPU idle, median of 20;
``stages_us``: from a call's start to each launch's entry into Triton and its return (the kernels' ``run``
wrapped), medians of 20 calls from an idle GPU; ``launch_us``: one launch of the gate pass queued through
``kernel[grid](...)`` against the same launch through its compiled kernel (``CompiledKernel[grid](*args)``,
without the per-call binding and specialisation), median per launch over 200 back to back; then a cProfile of
20 calls, the functions by their own time and by cumulative time.

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

from flashinfra.kernels import kda_prefill_v3 as v3  # noqa: E402
from flashinfra.kernels.kda_prefill import kda_prefill_launch  # noqa: E402


def launch_stages(call_args) -> dict:
    """Median microseconds from a call's start to each v3 launch's entry into Triton's ``run`` and its return."""
    kernels = {"gate": v3.kda_gate_pass_kernel, "D": v3.kda_intra64_diag_kernel,
               "A": v3.kda_intra64_offdiag_rows_kernel, "B": v3.kda_intra64_b_kernel, "state": v3.kda_state64_kernel}
    marks: list[tuple[str, float]] = []
    saved = {name: k.run for name, k in kernels.items()}

    def timed(name, run):
        def wrapper(*args, **kwargs):
            marks.append((name + "_in", time.perf_counter()))
            out = run(*args, **kwargs)
            marks.append((name + "_out", time.perf_counter()))
            return out
        return wrapper

    samples: dict[str, list[float]] = {}
    try:
        for name, k in kernels.items():
            k.run = timed(name, saved[name])
        for _ in range(20):
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            kda_prefill_launch(*call_args)
            samples.setdefault("call_out", []).append((time.perf_counter() - t0) * 1e6)
            for name, t in marks:
                samples.setdefault(name, []).append((t - t0) * 1e6)
    finally:
        for name, k in kernels.items():
            k.run = saved[name]
    torch.cuda.synchronize()
    return {name: round(statistics.median(v), 1) for name, v in samples.items()}


def launch_costs(a) -> dict:
    """The gate pass queued 200 times back to back through ``kernel[grid](...)`` and through its compiled kernel."""
    T, H, K = a["q"].shape
    cu = torch.tensor(a["cu"], dtype=torch.int32, device="cuda")
    idx = torch.tensor([[0, c] for c in range(T // 64)], dtype=torch.int32, device="cuda").view(-1)
    gc = torch.empty(T // 64, H, 64, K, device="cuda")
    bc = torch.empty(T // 64, H, 64, device="cuda")
    g, beta = a["g"], a["beta"]
    grid = (T // 64 * (K // 32), H)
    consts = dict(H=H, K=K, BK=32, GATE_IN_KERNEL=False, HAS_LOWER_BOUND=False, BETA_LOGITS=False)
    args = (g, beta, g, g, 0.0, cu, idx, gc, bc, g.stride(0), beta.stride(0))

    def jit():
        return v3.kda_gate_pass_kernel[grid](*args, **consts, num_warps=1)

    compiled = jit()
    runner = compiled[(*grid, 1)]
    full = [*args, *consts.values()]  # every parameter in order, the constexprs last as declared

    def direct():
        runner(*full)

    out = {}
    for name, fn in (("jit", jit), ("compiled", direct), ("jit_again", jit)):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        out[name] = round((time.perf_counter() - t) / 200 * 1e6, 2)
        torch.cuda.synchronize()
    return out


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
    stages = launch_stages(call_args)
    launch = launch_costs(a)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        kda_prefill_launch(*call_args)
    prof.disable()
    torch.cuda.synchronize()
    res = header() | {"enqueue_us": enqueue, "from_idle_us": idle, "stages_us": stages, "launch_us": launch,
                      "profile": {}}
    for order in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(18)
        res["profile"][order] = text.getvalue()
    print(f"enqueue per call (GPU busy) {enqueue:.1f} us; host time of a call from idle, median {idle:.1f} us")
    print("stages (us from the call's start):", stages)
    print("one launch (us):", launch)
    print(res["profile"]["tottime"])
    write_results("kda_prefill_host", res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
