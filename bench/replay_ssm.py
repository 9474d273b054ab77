"""ReplaySSM against the copy-per-draft baseline for one GLM-5.3-Flash KDA layer (H=64, K=V=128, conv width 4, bf16
activations, float32 state): the time of a speculative step's state work and the state bytes each keeps per request.

- ReplaySSM (what ships): the verify kernel runs the ``k + 1`` tokens of every row from its committed checkpoint,
  writing only the ring, then the fold replays the ``a`` accepted entries into the checkpoint
  (``kda_layer_verify_launch`` + ``kda_fold_launch``). State per request: one state and conv window, plus a ring of
  ``k + 1`` entries.
- Copy per draft (vLLM's MTP path for linear attention): before each of the ``k + 1`` tokens the row's state and conv
  window are copied into a fresh slot, and the decode kernel steps that slot; acceptance then names the slot to keep,
  so it costs nothing here. State per request: ``k + 2`` states and windows.

Both are timed as one call replayed from a CUDA graph (``timing.time_graph``), for every (batch, k) and ``a = k``
(every draft accepted: the fold's most work). The floor of each is its state bytes over the copy bandwidth measured
in the same run. The table comes last; the JSON goes to ``--out``.

    python bench/replay_ssm.py --out bench/results/replay_ssm.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from flashinfra.feedback.timing import copy_bandwidth_GBps, header, time_graph, write_results  # noqa: E402
from flashinfra.kernels.kda.decode import kda_layer_decode_launch  # noqa: E402
from flashinfra.kernels.kda.fold import kda_fold_launch  # noqa: E402
from flashinfra.kernels.kda.verify import kda_layer_verify_launch  # noqa: E402
from flashinfra.model.replay import ReplayRing  # noqa: E402

H, K, W = 64, 128, 4  # GLM-5.3-Flash's KDA layer; ``--smoke`` runs a small one under the interpreter


def layer_inputs(B: int, q: int, device: str, H: int = H, K: int = K) -> dict:
    """One layer's arguments for ``B`` rows of ``q`` tokens each, the rows in slots ``0 .. B - 1`` of ``(k + 2) B``
    slots (room for the baseline's copies)."""
    gen = torch.Generator(device=device).manual_seed(B * 10 + q)
    T, C, S = B * q, 3 * H * K, B * (q + 1)

    def rnd(*shape, dt=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dt)

    return dict(qkv=rnd(T, C), conv_weight=rnd(C, W, dt=torch.float32, scale=0.5), conv_state=rnd(S, C, W - 1),
                g_raw=rnd(T, H * K), beta_logits=rnd(T, H), gate=rnd(T, H * K),
                A_log=rnd(H, dt=torch.float32, scale=0.3), dt_bias=rnd(H * K, dt=torch.float32), lower_bound=-5.0,
                norm_weight=rnd(K), eps=1e-5, state=rnd(S, H, K, K, dt=torch.float32, scale=0.3))


def replay_step(B: int, k: int, device: str, H: int = H, K: int = K):
    """The ReplaySSM step's state work: verify ``k + 1`` tokens per row, fold ``k`` of them."""
    a = layer_inputs(B, k + 1, device, H, K)
    ring = ReplayRing.allocate(a["state"].shape[0], k + 1, H, K, K, torch.bfloat16, device)
    slots = torch.arange(B, dtype=torch.int32, device=device)
    cu = torch.arange(0, B * (k + 1) + 1, k + 1, dtype=torch.int32, device=device)
    accepted = torch.full((B,), k, dtype=torch.int32, device=device)
    out = torch.empty(B * (k + 1), H, K, dtype=torch.bfloat16, device=device)

    def step():
        kda_layer_verify_launch(**a, ring=ring, state_slots=slots, cu_seqlens=cu, out=out)
        kda_fold_launch(ring, a["conv_state"], a["state"], slots, accepted)

    return step


def copy_step(B: int, k: int, device: str, H: int = H, K: int = K):
    """The copy-per-draft step's state work: for each of the ``k + 1`` tokens, every row's state and conv window
    copied into its next slot (the rows' slots are consecutive: one copy each), then one decode step there. Our decode
    kernel steps a slot in place, so this moves twice the bytes of a kernel that would read one slot and write the
    next: ``floors`` gives that kernel's floor as the baseline's."""
    a = layer_inputs(B, k + 1, device, H, K)
    state, conv = a["state"], a["conv_state"]
    slots = [torch.arange(B * j, B * (j + 1), device=device) for j in range(k + 2)]
    rows = [torch.arange(B, device=device) * (k + 1) + j for j in range(k + 1)]  # token j of every row
    per_token = [{n: a[n][r] for n in ("qkv", "g_raw", "beta_logits", "gate")} for r in rows]
    out = torch.empty(B, H, K, dtype=torch.bfloat16, device=device)

    def step():
        for j in range(k + 1):
            state[B * (j + 1) : B * (j + 2)].copy_(state[B * j : B * (j + 1)])
            conv[B * (j + 1) : B * (j + 2)].copy_(conv[B * j : B * (j + 1)])
            kda_layer_decode_launch(**per_token[j], conv_weight=a["conv_weight"], conv_state=conv, A_log=a["A_log"],
                                    dt_bias=a["dt_bias"], lower_bound=a["lower_bound"], norm_weight=a["norm_weight"],
                                    eps=a["eps"], state=state, state_slots=slots[j + 1], out=out)

    return step


def floors(B: int, k: int, gbps: float) -> dict:
    """Bytes each must move per layer (states and conv windows only; the token rows are the same for both) and the
    time they take at the measured copy bandwidth."""
    state, window = H * K * K * 4, 3 * H * K * (W - 1) * 2
    ring_entry = 3 * H * K * 2 + 2 * H * K * 2 + H * K * 4 + H * 4  # x, k, v (bf16), g, beta (fp32)
    replay = B * (state + (k + 1) * ring_entry + 2 * state + k * ring_entry + 2 * window)  # verify, then fold
    copies = B * (k + 1) * 2 * (state + window)  # each token: one slot read, the next written
    return dict(replay_bytes=replay, copy_bytes=copies, replay_floor_us=replay / gbps / 1e3,
                copy_floor_us=copies / gbps / 1e3,
                state_bytes_per_request=dict(replay=state + window + (k + 1) * ring_entry,
                                             copies=(k + 2) * (state + window)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="run each step once, small, under the Triton interpreter")
    args = ap.parse_args()
    if args.smoke:  # TRITON_INTERPRET=1 python bench/replay_ssm.py --smoke
        for k in (1, 3):
            replay_step(2, k, "cpu", H=2, K=16)()
            copy_step(2, k, "cpu", H=2, K=16)()
        print("smoke: both steps ran")
        return
    if not torch.cuda.is_available():
        raise SystemExit("replay_ssm.py times CUDA graphs: it needs a GPU")
    device = "cuda"
    gbps = copy_bandwidth_GBps(device)
    rows = []
    for B in args.batches:
        for k in args.ks:
            replay_us = time_graph(replay_step(B, k, device))
            copy_us = time_graph(copy_step(B, k, device))
            f = floors(B, k, gbps)
            rows.append(dict(batch=B, k=k, replay_us=replay_us, copy_us=copy_us, copy_over_replay=copy_us / replay_us,
                             replay_floor_fraction=f["replay_floor_us"] / replay_us,
                             copy_floor_fraction=f["copy_floor_us"] / copy_us, **f))
            torch.cuda.empty_cache()
    result = dict(header(), layer=dict(H=H, K=K, V=K, conv_width=W, activations="bfloat16", state="float32"),
                  copy_GBps=gbps, rows=rows)
    if args.out:
        write_results(os.path.splitext(os.path.basename(args.out))[0], result,
                      directory=os.path.dirname(args.out) or ".")
    print("| batch | k | ReplaySSM | copy per draft | copies / replay | state bytes per request (replay / copies) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        s = r["state_bytes_per_request"]
        print(f"| {r['batch']} | {r['k']} | {r['replay_us']:.1f} us ({100 * r['replay_floor_fraction']:.0f}% of "
              f"floor) | {r['copy_us']:.1f} us ({100 * r['copy_floor_fraction']:.0f}%) | {r['copy_over_replay']:.2f} "
              f"| {s['replay'] / 2**20:.2f} / {s['copies'] / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
