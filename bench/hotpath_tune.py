"""Block-shape sweep of the hot-path kernels whose launchers pick block shapes by size (fused MoE, sparse
MLA): each candidate replaces the launcher's ``_config`` for one registered benchmark, is timed from a
CUDA graph like ``bench/hotpath_kernels.py``, and its output is compared with the current choice's on the
same inputs (a faster shape that changes the result is reported as wrong, not as a win).

usage: python bench/hotpath_tune.py [--runs N] [--out bench/results/hotpath_tune.json]
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from flashinfra.feedback import ceilings, registry
from flashinfra.feedback.bench import run_spec
from flashinfra.feedback.registry import BenchContext
from flashinfra.kernels import fused_moe, sparse_mla


def moe(BM, BN1, BN2, BK, w, s):
    return dict(BM=BM, BN1=BN1, BN2=BN2, BK=BK, num_warps=w, num_stages=s)


def mla(BH, BN, w, s):
    return dict(BH=BH, BN=BN, num_warps=w, num_stages=s)


# the first candidate of each list is the launcher's current choice at that size (the reference output)
MOE_DECODE = [moe(16, 64, 64, 128, 4, 4), moe(16, 32, 32, 128, 4, 4), moe(16, 64, 64, 256, 4, 3),
              moe(16, 128, 128, 128, 4, 4), moe(16, 64, 64, 128, 4, 6), moe(16, 32, 64, 256, 2, 4)]
MOE_SMALL = [moe(16, 128, 128, 128, 4, 4), moe(16, 64, 64, 128, 4, 4), moe(16, 128, 128, 256, 4, 3),
             moe(16, 256, 256, 128, 8, 3), moe(32, 128, 128, 128, 4, 4)]
MOE_LARGE = [moe(128, 128, 128, 64, 8, 3), moe(128, 128, 256, 64, 8, 3), moe(128, 128, 128, 64, 8, 4),
             moe(128, 128, 128, 128, 8, 2), moe(128, 256, 128, 64, 8, 3), moe(64, 128, 128, 64, 4, 4)]
MLA = [mla(64, 64, 8, 2), mla(64, 64, 8, 3), mla(64, 128, 8, 2), mla(64, 32, 8, 3), mla(64, 64, 4, 2),
       mla(32, 64, 8, 2)]
SWEEPS = {
    "hotpath.moe.t1": (fused_moe, MOE_DECODE),
    "hotpath.moe.t32": (fused_moe, MOE_SMALL),
    "hotpath.moe.t128": (fused_moe, MOE_SMALL),
    "hotpath.moe.t8192": (fused_moe, MOE_LARGE),
    "hotpath.sparse_mla.b32.n4096.t32": (sparse_mla, MLA),
    "hotpath.sparse_mla.b128.n4096.t128": (sparse_mla, MLA),
    "hotpath.sparse_mla.b1.n8192.t8192": (sparse_mla, MLA),
}


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--out", default="bench/results/hotpath_tune.json")
    args = ap.parse_args()
    ceil = ceilings.measure("cuda")
    registry.load_providers(("flashinfra.kernels.hotpath_checks",))
    specs = registry.benchmarks()
    ctx = BenchContext(device="cuda", dtype="bfloat16")
    report = {"date": datetime.now(timezone.utc).isoformat(), "device": torch.cuda.get_device_name(),
              "ceilings": ceil, "command": f"python bench/hotpath_tune.py --runs {args.runs}", "sweeps": {}}
    for name, (module, candidates) in SWEEPS.items():
        spec = specs[name].fn(ctx)
        current = module._config
        probe = spec.make_inputs(12345)
        want = spec.fn(*probe)
        rows = []
        for cfg in candidates:
            module._config = lambda *_a, cfg=cfg: dict(cfg)
            try:
                err = _rel(spec.fn(*probe), want)
                r = run_spec(name, spec, "cuda", runs=args.runs, ceilings=ceil, graph=True)
                rows.append(dict(config=cfg, median_s=r["median_s"], rel_err_vs_current=err, timing=r["timing"]))
            except Exception as exc:  # a shape that does not compile (registers, shared memory)
                rows.append(dict(config=cfg, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            finally:
                module._config = current
            torch.cuda.synchronize()
        report["sweeps"][name] = rows
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    for name, rows in report["sweeps"].items():
        print(name)
        for r in rows:
            text = (f"{r['median_s'] * 1e6:9.1f} us  err {r['rel_err_vs_current']:.1e}" if "median_s" in r
                    else r["error"][:60])
            print(f"   {json.dumps(r['config'])}  {text}")


if __name__ == "__main__":
    main()
