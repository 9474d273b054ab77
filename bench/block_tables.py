"""Host time to prepare a step's batch inputs (issue #40): the block tables kept as arrays between steps
(``engine/block_tables.py``) and the whole-array ``ForwardBatch.host_arrays``, against a given revision's
``ForwardBatch`` fed a copy of each request's list, as the scheduler handed them out before.

Cases: decode rows at 4k context (batch 1 / 32 / 128), one decode row at 128k and 1M (block size 16: 65,536 blocks
at 1M), an 8192-token prompt, and a mixed step (63 decode rows and a 2000-token chunk). Each is the median of
``--steps`` preparations: ``host_arrays``, the packed upload (``HostStaging.upload``) and ``from_views``. CPU only, one
thread (the upload to a CPU "device" is then a memcpy, as the pinned copy's host side is on a GPU host): the host
work is the subject; on a GPU it hides under the device's step only with asynchronous scheduling.

    python bench/block_tables.py --before 47b6350   # bench/results/block_tables_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flashinfra.feedback.timing import header, write_results  # noqa: E402
from flashinfra.model.forward_batch import ForwardBatch  # noqa: E402
from flashinfra.model.staging import HostStaging  # noqa: E402
from revisions import revision_module  # noqa: E402

BS = 16
# name: (query lengths, context lengths)
CASES = {
    "decode_b1_4k": ([1], [4096]),
    "decode_b32_4k": ([1] * 32, [4096] * 32),
    "decode_b128_4k": ([1] * 128, [4096] * 128),
    "decode_b1_128k": ([1], [131072]),
    "decode_b1_1m": ([1], [1048576]),
    "prefill_8192": ([8192], [0]),
    "mixed_63x1_2000": ([1] * 63 + [2000], [4096] * 63 + [0]),
}


def median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a git revision whose ForwardBatch to time beside this tree's")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="bench/results/block_tables_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    before = revision_module(args.before, "flashinfra/model/forward_batch.py").ForwardBatch if args.before else None
    staging, rows = HostStaging("cpu"), []
    for name, (qlens, ctxs) in CASES.items():
        B = len(qlens)
        lists = [list(range(b * 70000, b * 70000 - (-(c + q) // BS))) for b, (q, c) in enumerate(zip(qlens, ctxs))]
        kept = [np.asarray(t, dtype=np.int32) for t in lists]  # what BlockTables hands the runner
        slots = list(range(B))

        def now():
            views = staging.upload(ForwardBatch.host_arrays(qlens, ctxs, slots, kept, BS))
            ForwardBatch.from_views(qlens, ctxs, slots, kept, BS, views)

        row = dict(case=name, sequences=B, tokens=sum(qlens), blocks=sum(map(len, lists)),
                   now_ms=median_ms(now, args.steps))
        if before is not None:
            def then():
                tables = [list(t) for t in lists]  # the scheduler's copy of each list
                views = staging.upload(before.host_arrays(qlens, ctxs, slots, tables, BS))
                before.from_views(qlens, ctxs, slots, tables, BS, views)

            row["before_ms"] = median_ms(then, args.steps)
            row["speedup"] = row["before_ms"] / row["now_ms"]
        rows.append(row)
        print(f"{name:18s} now {row['now_ms']:.3f} ms" + (f", {args.before} {row['before_ms']:.3f} ms "
                                                          f"({row['speedup']:.1f}x)" if before is not None else ""),
              flush=True)
    out = Path(args.out)
    write_results(out.stem, header() | dict(block_size=BS, steps=args.steps, before=args.before, rows=rows),
                  directory=out.parent)


if __name__ == "__main__":
    main()
