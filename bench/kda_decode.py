"""KDA decode on the GPU: our bare recurrence, our fused whole-layer decode (fp32 and bf16 state, its
default configuration eager and in a CUDA graph, and its layout / block / warps variants in a graph) and
flash-linear-attention's fused_recurrent_kda (bare, and with the conv update and gated RMSNorm it needs
around it), H=64, K=V=128, at B=1, 16, 64, 256, all in one run.

    python bench/kda_decode.py [--out DIR] [--no-variants]     -> bench/results/kda_decode.json

Keys ``parts_{fp32,bf16}_{layout}_{prep,state,norm}_graph_us``: each launch of a multi-launch layout timed
alone in a graph (the default layout per size and the streaming layouts' lead variants), for the time split;
with ``_preph{n}_prepw{n}_normh{n}_normw{n}`` in the layout, the prep and norm launches with several heads per
program (``kda_layer_decode_prep.HEADS_OPTIONS``), timed alone with the default layout and, in the
``ours_layer_*`` rows, as whole layers under the prep, tiles and stream layouts; ``_pdl``: the block layout's
norm launch as a programmatic dependent of its state launch. Keys ``ours_recurrence_{fp32,bf16}_BV{n}_w{n}[_r{n}]``:
the bare recurrence (``kda_decode_launch``) at other block widths, warps and register caps than
``recurrence_config``'s. ``--match REGEX`` times only the variant and parts keys it matches (the default and FLA rows
always).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import (  # noqa: E402
    copy_bandwidth_GBps,
    fla_version,
    header,
    relerr,
    time_eager,
    time_graph,
    write_results,
)

from flashinfra.kernels.kda.decode_recurrence import kda_decode_launch  # noqa: E402
from flashinfra.kernels.kda.decode import (  # noqa: E402
    decode_config,
    kda_layer_decode_launch,
    kda_layer_decode_ref,
)
from flashinfra.kernels.kda.decode_prep import HEADS_OPTIONS  # noqa: E402
from flashinfra.kernels.kda.decode_stream import PLAIN4, STREAM_VARIANTS  # noqa: E402

H, K, V, W, LB, EPS = 64, 128, 128, 4, -5.0, 1e-5
C = 3 * H * K
# (grid, BV, num_warps[, launch options]) of the layer decode, each timed in a graph at every batch size and state
# dtype. Left out since the 04:47 UTC run (bench/results/kda_decode_prep.json): block BV 32 / 8 warps, BV 64 / 8,
# BV 128 / 8 and head BV 16 / 4, BV 64 / 8, each at least 1.27x the best variant at every size and state dtype there.
# Left out since the 06:44 UTC run (bench/notes/kda_decode.md, "prep launch"): the prep launch with 4, 8 or 16 heads
# per program (the layer slower than the default at every size and state dtype), and pdl on the prep, tiles and stream
# layouts (where it beat the same layout without it, B=1 and tiles at B=16, another variant was faster still; where
# those layouts are the default, within 0.5% or slower). Removed since (13:0x UTC): the head and stream_regs layouts,
# slower than the defaults at every size and state dtype in every run that timed them; and (15:1x UTC) the
# overlapped launches (norm_overlap, prep_overlap), slower than the defaults at B=64 and 256 in both state dtypes
# (bench/results/kda_decode_overlap.json). Timed once and left out (16:0x-16:3x UTC): the one-head prep on 1 or 2 warps and
# the 4-head norm on 1 or 2 (bench/results/kda_decode_prep_warps.json), 2 or 4 heads per prep program at one channel
# per thread (8 or 16 warps; bench/results/kda_decode_prep_ctas.json), and the halves layout, whole heads as two
# column halves with the norm in the state kernel (bench/results/kda_decode_halves.json): slower than the defaults.
VARIANTS = [("block", 16, 1), ("block", 16, 2), ("block", 16, 4), ("block", 32, 2), ("block", 32, 4), ("block", 64, 4),
            ("prep", 16, 2), ("prep", 32, 2), ("prep", 32, 4), ("prep", 64, 4),
            *STREAM_VARIANTS,
            *[v for o in HEADS_OPTIONS for v in (("prep", 64, 4, o), ("tiles", 64, 4, dict(maxnreg=96, **o)),
                                                 ("stream", 32, 2, o))],
            ("block", 32, 2, dict(pdl=True)),  # the norm launch as a programmatic dependent (B=1's default)
            ("prep", 64, 4, dict(prep_heads=1, prep_warps=4, norm_heads=4, norm_warps=4)),  # one-head prep, 4-head norm
            ("tiles", 64, 4, dict(maxnreg=96, prep_heads=1, prep_warps=4, norm_heads=4, norm_warps=4))]


# (BV, num_warps, maxnreg) of the bare recurrence (kda_decode_launch), each timed in a graph at every batch size and
# state dtype as ``ours_recurrence_{fp32,bf16}_BV{n}_w{n}[_r{n}]``
RECURRENCE_VARIANTS = [(32, 4, None), (32, 2, None), (32, 2, 112), (32, 2, 104), (64, 4, None), (64, 4, 96), (64, 8, None),
                       (128, 8, None), (16, 2, None), (16, 1, None)]


def variant_tag(grid: str, bv: int, nw: int, launch: dict | None = None) -> str:
    launch = launch or {}
    return (f"{grid}_BV{bv}_w{nw}" + (f"_s{launch['num_stages']}" if "num_stages" in launch else "")
            + ("_plainstore" if launch.get("tma_store") is False else "")
            + ("_scratchL2" if launch.get("scratch_l2") else "")
            + (f"_r{launch['maxnreg']}" if "maxnreg" in launch else "")
            + (f"_preph{launch['prep_heads']}" if "prep_heads" in launch else "")
            + (f"_prepw{launch['prep_warps']}" if "prep_warps" in launch else "")
            + (f"_normh{launch['norm_heads']}" if "norm_heads" in launch else "")
            + (f"_normw{launch['norm_warps']}" if "norm_warps" in launch else "")
            + ("_pdl" if launch.get("pdl") else ""))


def layer_inputs(B: int, state_dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    return dict(
        qkv=rnd(B, C), conv_weight=rnd(C, W, dtype=torch.float32, scale=0.5), conv_state=rnd(B, C, W - 1),
        g_raw=rnd(B, H * K), beta_logits=rnd(B, H), gate=rnd(B, H * V), A_log=rnd(H, dtype=torch.float32, scale=0.3),
        dt_bias=rnd(H * K, dtype=torch.float32), lower_bound=LB, norm_weight=rnd(V), eps=EPS,
        state=rnd(B, H, K, V, dtype=state_dtype, scale=0.1),
        state_slots=torch.randperm(B, device="cuda", generator=gen),
    )


def layer_bytes(B: int, state_bytes: int) -> int:
    state = B * H * K * V * state_bytes * 2
    conv = B * C * (W - 1) * 2 * 2
    io = B * (C + H * K + H + H * V) * 2 + B * H * V * 2
    return state + conv + io


def layer_reference(a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer step on ``a`` in float64 (the unfused reference): its output and the new recurrent states."""
    r = {k: (v.double().clone() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in a.items()}
    return kda_layer_decode_ref(**r), r["state"]


def time_layer_variant(row: dict, name: str, fn, a: dict, ref: tuple, B: int, state_bytes: int) -> None:
    """A layer launch ``fn(**inputs)`` on fresh copies of ``a``'s states: into ``row``, its output's and new state's
    errors against ``ref`` (``layer_reference(a)``), then its time in a CUDA graph and its share of
    ``layer_bytes`` in GB/s."""
    x = {**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()}
    out = fn(**x)
    row[name + "_relerr_o"] = relerr(out, ref[0])
    row[name + "_relerr_state"] = relerr(x["state"], ref[1])
    row[name + "_graph_us"] = time_graph(lambda: fn(**x))
    row[name + "_frac_copy"] = layer_bytes(B, state_bytes) / row[name + "_graph_us"] / 1e3


def check_layer(B: int, state_dtype: torch.dtype) -> float:
    """Relative error of the fused kernel's output against the unfused reference computed in float64 on the same
    inputs (the reference first: the launch updates the states in place)."""
    a = layer_inputs(B, state_dtype, seed=123)
    ref = layer_reference(a)[0]
    return relerr(kda_layer_decode_launch(**a), ref)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also copy the JSON into this folder")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="skip the layout / block-size / warps variants of the layer decode")
    ap.add_argument("--match", help="time only the variant and parts keys matching this regular expression")
    args = ap.parse_args()
    res = header()
    res["fla"] = fla_version()
    res["shape"] = dict(H=H, K=K, V=V, W=W)
    res["copy_GBps"] = copy_bandwidth_GBps()
    print(f"copy {res['copy_GBps']:.0f} GB/s", flush=True)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        row = {"B": B}
        fp32 = layer_inputs(B, torch.float32, seed=B)
        bf16 = layer_inputs(B, torch.bfloat16, seed=B + 1)
        q, k, v = (t.view(B, H, -1) for t in fp32["qkv"].split([H * K, H * K, H * V], dim=1))
        g = (LB * torch.sigmoid(torch.randn(B, H, K, device="cuda"))).float()
        beta = torch.rand(B, H, device="cuda")
        slots = fp32["state_slots"]
        cases = {
            "ours_recurrence_fp32": lambda: kda_decode_launch(q, k, v, g, beta, fp32["state"], slots),
            "ours_recurrence_bf16": lambda: kda_decode_launch(q, k, v, g, beta, bf16["state"], slots),
            "ours_layer_fp32": lambda: kda_layer_decode_launch(**fp32),
            "ours_layer_bf16": lambda: kda_layer_decode_launch(**bf16),
        }
        row["config_fp32"] = decode_config(B, torch.float32)
        row["config_bf16"] = decode_config(B, torch.bfloat16)
        row["bytes_layer_fp32"] = layer_bytes(B, 4)
        row["bytes_layer_bf16"] = layer_bytes(B, 2)
        row["bytes_recurrence_fp32"] = B * H * K * V * 4 * 2
        row["bytes_recurrence_bf16"] = B * H * K * V * 2 * 2
        try:
            from fla.modules.causal_conv1d.ops import causal_conv1d_update
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            from fla.ops.kda import fused_recurrent_kda

            q4, k4, v4 = (t.unsqueeze(1).contiguous() for t in (q, k, v))
            g4, beta4 = g.unsqueeze(1), beta.bfloat16().unsqueeze(1)
            h0 = fp32["state"].clone()
            cache = torch.randn(B, C, W, device="cuda", dtype=torch.bfloat16)
            a = fp32

            def fla_layer():
                y, _ = causal_conv1d_update(a["qkv"], cache, weight=a["conv_weight"], activation="silu")
                qq, kk, vv = (t.view(B, 1, H, -1) for t in y.split([H * K, H * K, H * V], dim=1))
                o, ht = fused_recurrent_kda(
                    qq, kk, vv, a["g_raw"].view(B, 1, H, K), a["beta_logits"].view(B, 1, H), A_log=a["A_log"],
                    dt_bias=a["dt_bias"], scale=K**-0.5, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                    lower_bound=LB,
                )
                return rms_norm_gated(o.view(B * H, V), a["gate"].view(B * H, V), a["norm_weight"], None,
                                      activation="sigmoid", eps=EPS)

            cases["fla_recurrence_fp32"] = lambda: fused_recurrent_kda(
                q4, k4, v4, g4, beta4, scale=K**-0.5, initial_state=h0, output_final_state=True)
            cases["fla_layer_fp32"] = fla_layer
        except ImportError as exc:
            row["fla_error"] = repr(exc)
        timed = set(cases)
        if args.variants:
            for grid, bv, nw, *opt in VARIANTS:
                launch = opt[0] if opt else {}
                for dt, inputs in (("fp32", fp32), ("bf16", bf16)):
                    cases[f"ours_layer_{dt}_{variant_tag(grid, bv, nw, launch)}"] = (
                        lambda i=inputs, g=grid, b=bv, w=nw, o=launch: kda_layer_decode_launch(
                            **i, grid=g, BV=b, num_warps=w, **o))
            for bv, nw, cap in RECURRENCE_VARIANTS:
                for dt, st in (("fp32", fp32["state"]), ("bf16", bf16["state"])):
                    cases[f"ours_recurrence_{dt}_BV{bv}_w{nw}" + (f"_r{cap}" if cap else "")] = (
                        lambda s=st, b=bv, w=nw, c=cap: kda_decode_launch(q, k, v, g, beta, s, slots, BV=b,
                                                                          num_warps=w, maxnreg=c))
            # each launch of the default layout and of the streaming layouts' lead variants alone (graph), for the
            # whole batch (the micro-batches' two streams would overlap what this splits)
            for dt, inputs, sdt in (("fp32", fp32, torch.float32), ("bf16", bf16, torch.bfloat16)):
                cfg = dict(decode_config(B, sdt))
                cfg.pop("micro_batches", None)
                default = (cfg.pop("grid"), cfg.pop("BV"), cfg.pop("num_warps"), cfg)
                heads = [(*default[:3], {**default[3], **o}, ("prep", "norm")) for o in HEADS_OPTIONS]
                for grid, bv, nw, *opt in (default, ("stream", 64, 4, PLAIN4), ("prep", 64, 4), ("tiles", 64, 4),
                                           ("tiles", 64, 4, dict(prep_warps=1, norm_warps=1)),
                                           ("tiles", 64, 4, dict(prep_warps=2, norm_warps=2)), *heads):
                    launch = opt[0] if opt else {}
                    if grid == "block":
                        continue
                    for part in (opt[1] if len(opt) > 1 else ("prep", "state", "norm")):
                        cases[f"parts_{dt}_{variant_tag(grid, bv, nw, launch)}_{part}"] = (
                            lambda i=inputs, g=grid, b=bv, w=nw, o=launch, p=part: kda_layer_decode_launch(
                                **i, grid=g, BV=b, num_warps=w, launches=p, **o))
        for name, fn in cases.items():
            if args.match and name not in timed and not re.search(args.match, name):
                continue
            try:
                if name in timed:  # the variants are timed in a graph only
                    row[f"{name}_eager_us"] = time_eager(fn)
                row[f"{name}_graph_us"] = time_graph(fn)
            except Exception as exc:  # one failing case must not hide the others' numbers
                row[f"{name}_error"] = repr(exc)[:300]
        for name, key in (("ours_layer_fp32", "bytes_layer_fp32"), ("ours_layer_bf16", "bytes_layer_bf16"),
                          ("ours_recurrence_fp32", "bytes_recurrence_fp32"),
                          ("ours_recurrence_bf16", "bytes_recurrence_bf16"),
                          ("fla_recurrence_fp32", "bytes_recurrence_fp32")):
            if f"{name}_graph_us" in row:
                row[f"{name}_graph_GBps"] = row[key] / row[f"{name}_graph_us"] / 1e3
                row[f"{name}_graph_frac_copy"] = row[f"{name}_graph_GBps"] / res["copy_GBps"]
        row["relerr_layer_fp32_vs_fp64"] = check_layer(min(B, 16), torch.float32)
        row["relerr_layer_bf16_vs_fp64"] = check_layer(min(B, 16), torch.bfloat16)
        rows.append(row)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        res["rows"] = rows
        write_results("kda_decode", res, args.out)  # after each batch size, so a cut-short run keeps its rows
    summary(rows)
    return 0


def summary(rows: list[dict]) -> None:
    """Graph microseconds: the default layer decode per state dtype, its fastest variant, FLA."""
    print(f"{'B':>4} {'fp32':>8} {'best fp32 variant':>28} {'bf16':>8} {'best bf16 variant':>28} {'FLA rec':>8} "
          f"{'FLA layer':>9}")
    for row in rows:
        cells = [f"{row['B']:>4}"]
        for dt in ("fp32", "bf16"):
            cells.append(f"{row.get(f'ours_layer_{dt}_graph_us', float('nan')):8.2f}")
            var = {k[len(f"ours_layer_{dt}_"):-len("_graph_us")]: v for k, v in row.items()
                   if k.startswith(f"ours_layer_{dt}_") and k.endswith("_graph_us") and k.count("_BV")}
            best = min(var, key=var.get) if var else "-"
            cells.append(f"{best + ' ' + format(var.get(best, float('nan')), '.2f'):>28}")
        cells.append(f"{row.get('fla_recurrence_fp32_graph_us', float('nan')):8.2f}")
        cells.append(f"{row.get('fla_layer_fp32_graph_us', float('nan')):9.2f}")
        print(" ".join(cells), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
