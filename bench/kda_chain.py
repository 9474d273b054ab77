"""KDA context parallelism in one process that plays N ranks: the chain's precision (plain tf32 against tf32x3
against float64) and the cost of the summary pass against the plain prefill.

1. Precision, H=2, K=V=128, bf16 k/v, T in ``--lengths`` split into ``--ranks`` contiguous parts. Per part the
   transition map M (``kda_transition_launch``, tf32 and tf32x3) and H, the final state from zero (the shipped
   prefill kernels); the float64 truth from ``kda_transition_ref`` and ``kda_chunk_one_ref`` in float64. The maps
   are folded in float32 into every part's initial state, as the ranks do. Reported per regime: M's relative
   error (Frobenius) per part, worst part, and every part's initial state against the float64 fold (the state the
   rank's final pass starts from). Regimes: ``long`` (log-decay in (-1e-5, 0), beta near 0.0025: a part's state
   remembers all of it, M stays far from 0), ``slow`` (log-decay in (-0.02, 0), beta in (0, 1)), ``bound`` (the
   gate at the -5 lower bound: M vanishes within a part, only H matters).
2. Cost, H=64, K=V=128, bf16, one part of T / N tokens (what one rank runs): the plain prefill of the part, the
   summary pass (``kda_summary_launch``: M and H in one walk, tf32x3; M alone in tf32x3 and tf32 beside it), the
   fold of N maps. The summary pass
   plus the final pass against the plain prefill of the part is the price of context parallelism per KDA layer;
   the ideal is the part's prefill alone. Up to 262144 tokens also the whole prompt's prefill on one GPU, and its
   ratio to a rank's layer time (collectives left out).

    python bench/kda_chain.py [--lengths 65536,262144,1048576] [--ranks 8] [--regimes long,slow,bound]
                              [--no-cost] [--name kda_chain] [--out DIR]   -> bench/results/<name>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashinfra.feedback.timing import header, relerr, time_eager, write_results  # noqa: E402
from flashinfra.kernels.kda.chain import kda_summary_launch, kda_transition_launch  # noqa: E402
from flashinfra.kernels.kda.prefill import kda_prefill_launch  # noqa: E402
from flashinfra.kernels.kda.ref import kda_chunk_one_ref, kda_transition_ref, l2norm_ref  # noqa: E402
from flashinfra.parallel.context import fold  # noqa: E402

SEGMENT = 512  # tokens per float64 reference step (its in-chunk decay tensor grows with them)
WHOLE_MAX = 262144  # the longest prompt whose one-GPU prefill the cost part times (H=64)


def inputs(T: int, H: int, K: int, regime: str, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(3))
    x = torch.rand(T, H, K, device="cuda", generator=gen)
    if regime == "bound":
        g = -5.0 * torch.sigmoid(6.0 + torch.randn(T, H, K, device="cuda", generator=gen))
    else:
        g = -(1e-5 if regime == "long" else 0.02) * x
    beta = torch.sigmoid(torch.randn(T, H, device="cuda", generator=gen) - (6.0 if regime == "long" else 0.0))
    return q, k, v, g, beta


def state_from_zero_f64(k, v, g, beta) -> torch.Tensor:
    """The final state from zero in float64, ``SEGMENT`` tokens at a time."""
    T, H, K = k.shape
    s = torch.zeros(H, K, v.shape[-1], dtype=torch.float64, device=k.device)
    for a in range(0, T, SEGMENT):
        kn = l2norm_ref(k[a : a + SEGMENT].double())
        _, s = kda_chunk_one_ref(kn, kn, v[a : a + SEGMENT].double(), g[a : a + SEGMENT].double(),
                                 beta[a : a + SEGMENT].double(), s)
    return s


def precision_case(T: int, ranks: int, regime: str, H: int = 2, K: int = 128) -> dict:
    t0 = time.time()
    q, k, v, g, beta = inputs(T, H, K, regime, seed=T + len(regime))
    bounds = [T * r // ranks for r in range(ranks + 1)]
    maps = {"tf32": [], "tf32x3": [], "float64": []}
    offsets, offsets64 = [], []
    for a, b in zip(bounds, bounds[1:]):
        part = [x[a:b] for x in (q, k, v, g, beta)]
        for p in ("tf32", "tf32x3"):
            maps[p].append(kda_transition_launch(part[1], part[3], part[4], [0, b - a], precision=p)[0])
        maps["float64"].append(kda_transition_ref(part[1].double(), part[3].double(), part[4].double(), [0, b - a],
                                                  segment=SEGMENT)[0])
        state = torch.zeros(1, H, K, K, dtype=torch.float32, device="cuda")
        kda_prefill_launch(*part, state, [0, b - a], [0], [False])
        offsets.append(state[0])
        offsets64.append(state_from_zero_f64(*part[1:]))
    zero = torch.zeros(H, K, K, dtype=torch.float64, device="cuda")
    truth = [zero]  # the float64 fold: equal to one float64 pass over the whole sequence
    for m, h in zip(maps["float64"], offsets64):
        truth.append(m @ truth[-1] + h)
    row = {"T": T, "ranks": ranks, "H": H, "K": K, "regime": regime, "g_mean": float(g.mean()),
           "M_max_abs_last_part": float(maps["float64"][-1].abs().max())}
    for p in ("tf32", "tf32x3"):
        m_err = [relerr(m, m64) for m, m64 in zip(maps[p], maps["float64"])]
        states = fold(maps[p], offsets, zero.float())
        s_err = [relerr(s, s64) for s, s64 in zip(states[1:], truth[1:])]
        # at the -5 bound M underflows in float32 (its float64 value is far below 1e-30): no relative error there
        row[f"{p}_M_relerr_worst_part"] = max(m_err) if row["M_max_abs_last_part"] > 1e-30 else None
        row[f"{p}_initial_state_relerr_worst_rank"] = max(s_err[:-1], default=0.0)
        row[f"{p}_final_state_relerr"] = s_err[-1]
    row["H_relerr_worst_part"] = max(relerr(h, h64) for h, h64 in zip(offsets, offsets64))
    row["seconds"] = time.time() - t0
    return row


def cost_case(T: int, ranks: int, H: int = 64, K: int = 128) -> dict:
    n = T // ranks
    q, k, v, g, beta = inputs(n, H, K, "bound", seed=1)
    state = torch.zeros(1, H, K, K, dtype=torch.float32, device="cuda")
    maps = [torch.randn(H, K, K, device="cuda") for _ in range(ranks)]

    def prefill():
        kda_prefill_launch(q, k, v, g, beta, state, [0, n], [0], [False])

    row = {"T": T, "ranks": ranks, "part_tokens": n, "H": H, "K": K}
    row["prefill_part_us"] = time_eager(prefill, iters=5, warmup=2)
    for p in ("tf32x3", "tf32"):
        row[f"transition_{p}_us"] = time_eager(lambda: kda_transition_launch(k, g, beta, [0, n], precision=p),
                                               iters=5, warmup=2)
    row["summary_us"] = time_eager(lambda: kda_summary_launch(k, v, g, beta, [0, n]), iters=5, warmup=2)
    row["fold_us"] = time_eager(lambda: fold(maps, maps, state[0]), iters=5, warmup=2)
    summary = row["summary_us"]
    layer = summary + row["fold_us"] + row["prefill_part_us"]
    row["summary_over_prefill"] = summary / row["prefill_part_us"]
    row["cp_layer_over_part_prefill"] = layer / row["prefill_part_us"]
    del q, k, v, g, beta
    if T <= WHOLE_MAX:  # the whole prompt's prefill on one GPU, where it fits beside its scratch
        q, k, v, g, beta = inputs(T, H, K, "bound", seed=2)
        row["prefill_whole_us"] = time_eager(
            lambda: kda_prefill_launch(q, k, v, g, beta, state, [0, T], [0], [False]), iters=3, warmup=1)
        # per KDA layer, collectives left out: one GPU's time over a rank's
        row["whole_over_cp_layer"] = row["prefill_whole_us"] / layer
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="65536,262144,1048576")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--regimes", default="long,slow,bound")
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--name", default="kda_chain")
    ap.add_argument("--out", default=None, help="also copy the JSON into this folder")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fold in float32, as the ranks do it
    results = header()
    lengths = [int(x) for x in args.lengths.split(",")]
    results["precision"] = []
    for T in lengths:
        for regime in args.regimes.split(","):
            row = precision_case(T, args.ranks, regime)
            print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            results["precision"].append(row)
            write_results(args.name, results, copy_to=args.out)  # after every case: a cut-off run keeps its rows
    results["cost"] = []
    if not args.no_cost:
        for T in lengths:
            row = cost_case(T, args.ranks)
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            results["cost"].append(row)
            write_results(args.name, results, copy_to=args.out)
    print(write_results(args.name, results, copy_to=args.out))


if __name__ == "__main__":
    main()
