"""Host time of one KDA prefill call (v3, H=64, K=V=128, bf16): what the Python side costs per call, apart from
the GPU's work, for the plain op at T=8192 and the gated op (the engine's call) at T=8192 and 256.
``enqueue_us``: calls queued back to back while the GPU is busy with the earlier ones (no synchronisation inside),
per call; ``from_idle_us``: one call's host time with the GPU idle, median of 20; ``stages_us``: from a call's
start to each launch's entry into its launcher and its return, medians of 20 calls from an idle GPU;
``launch_us``: one launch of the gate pass queued through Triton's ``kernel[grid](...)``, through
``launch.fast`` (the compiled kernel kept per configuration) and through the compiled kernel's own runner,
median per launch over 200 back to back; then a cProfile of 20 gated calls at T=256, the functions by their own
time and by cumulative time.

    python bench/kda_prefill_host.py [--out DIR] [--name NAME]  -> bench/results/NAME.json (kda_prefill_host)
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

from flashinfra.kernels.kda import prefill_launch as v3  # noqa: E402
from flashinfra.kernels.kda.prefill import kda_prefill_gated_launch, kda_prefill_launch  # noqa: E402
try:
    from flashinfra.kernels.launch import fast  # noqa: E402
except ImportError:  # a tree from before launch.fast (A/B runs): its launches go through Triton's run
    fast = None


def launch_stages(call, call_args) -> dict:
    """Median microseconds from a call's start to each v3 launch's entry into its launcher (``launch.fast``) and
    its return."""
    kernels = {"gate": v3.kda_gate_pass_kernel, "D": v3.kda_intra64_diag_kernel,
               "A": v3.kda_intra64_offdiag_rows_kernel, "B": v3.kda_intra64_b_kernel, "state": v3.kda_state64_kernel}
    marks: list[tuple[str, float]] = []

    def timed(name, launch):
        def wrapper(*args, **kwargs):
            marks.append((name + "_in", time.perf_counter()))
            out = launch(*args, **kwargs)
            marks.append((name + "_out", time.perf_counter()))
            return out
        return wrapper

    samples: dict[str, list[float]] = {}
    hooked = {name: fast(k) if fast else k for name, k in kernels.items()}
    attr = "launch" if fast else "run"
    try:
        for name, k in hooked.items():
            setattr(k, attr, timed(name, getattr(k, attr)))
        for _ in range(20):
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            call(*call_args)
            samples.setdefault("call_out", []).append((time.perf_counter() - t0) * 1e6)
            for name, t in marks:
                samples.setdefault(name, []).append((t - t0) * 1e6)
    finally:
        for k in hooked.values():
            delattr(k, attr)  # the class's method again
    torch.cuda.synchronize()
    return {name: round(statistics.median(v), 1) for name, v in samples.items()}


def launch_costs(a) -> dict:
    """The gate pass queued 200 times back to back through ``kernel[grid](...)``, ``launch.fast`` and its compiled
    kernel's runner."""
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

    def fast_launch():
        fast(v3.kda_gate_pass_kernel)[grid](*args, **consts, num_warps=1)

    out = {}
    ways = (("jit", jit), ("fast", fast_launch), ("compiled", direct), ("jit_again", jit))
    for name, fn in ways if fast else ways[:1] + ways[2:]:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        out[name] = round((time.perf_counter() - t) / 200 * 1e6, 2)
        torch.cuda.synchronize()
    return out


def host_times(call, call_args) -> dict:
    """enqueue_us, from_idle_us and stages_us of one call (see the module's docstring)."""
    for _ in range(3):
        call(*call_args)
    torch.cuda.synchronize()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        call(*call_args)
    enqueue = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()

    def from_idle() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(*call_args)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) * 1e6

    idle = statistics.median(from_idle() for _ in range(20))
    return {"enqueue_us": round(enqueue, 1), "from_idle_us": round(idle, 1), "stages_us": launch_stages(call, call_args)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--name", default="kda_prefill_host")
    args = ap.parse_args()
    res = header() | {"cases": {}}
    for label, T, gated in (("plain_T8192", 8192, False), ("gated_T8192", 8192, True), ("gated_T256", 256, True)):
        a = inputs([T], seed=1)
        if gated:
            call, call_args = kda_prefill_gated_launch, (a["q"], a["k"], a["v"], a["g_raw"], a["beta_logits"],
                                                         a["A_log"], a["dt_bias"], -5.0, a["state"], a["cu"], [0],
                                                         [True])
        else:
            call, call_args = kda_prefill_launch, (a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["cu"],
                                                   [0], [True])
        res["cases"][label] = host_times(call, call_args)
        print(label, res["cases"][label], flush=True)
    res["launch_us"] = launch_costs(inputs([8192], seed=1))
    print("one launch (us):", res["launch_us"])
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(20):
        call(*call_args)
    prof.disable()
    torch.cuda.synchronize()
    res["profile"] = {}
    for order in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(18)
        res["profile"][order] = text.getvalue()
    write_results(args.name, res, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
