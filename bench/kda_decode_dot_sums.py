"""The bf16-state decode step with its two sums over K as one tensor-core product (``dot_sums``), against the
default step and flash-linear-attention's fused_recurrent_kda in the same run. CUDA graph, H=64, K=V=128.

Why (bench/notes/kda_decode.md, "The bf16 bare step's instructions by source line"): in the default bf16 program
the two reductions over K (``k^T S`` after the decay, ``q^T S'`` for the output) take 353 of its 944 instructions
per thread, and its time follows its instructions. A bf16 state block is exact as loaded, so both sums can run on
the tensor cores without rounding the state (``state_step_dot`` in kda_layer_decode_parts.py): ``k_n^T (d S) =
(k_n d)^T S`` and ``q_n^T S' = (q_n d)^T S + (q_n . k_n) delta``, the vectors as three bf16 parts each (about 24
bits), the rows of one [16, K] operand.

``--part bare``: the bare recurrence (``kda_decode_launch(dot_sums=True)``) at several block shapes, against the
default configuration and FLA's fp32 recurrence. ``--part layer``: the bf16 layer (bench/kda_decode.py's inputs)
with the tiles kernel's ``dot_sums``, at the default configuration's shape (capped at 96 registers), capped at 80
(six programs per SM) and uncapped, each against the same launch without it. Each variant is first checked against float64 (the output poisoned, the bf16 state updated in place
through random slots, the slots outside the batch unchanged), then timed.

    python bench/kda_decode_dot_sums.py [--part bare|layer] [--batches 64,256] [--out DIR]
        -> bench/results/kda_decode_dot_sums.json, kda_decode_dot_sums_layer.json
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_common import part_main, relerr, time_graph  # noqa: E402

from flashinfra.kernels.kda.decode_recurrence import kda_decode_launch, kda_decode_ref  # noqa: E402
from flashinfra.kernels.kda.decode import kda_layer_decode_launch  # noqa: E402

H, K, V = 64, 128, 128
# (BV, warps, register cap) of the bare variants timed; the default configuration is bf16 [K, 32] on 2 warps
VARIANTS = [(64, 4, None), (64, 4, 80), (32, 2, None), (128, 8, None)]
# the layer's launches timed with and without dot_sums ("default": decode_config's choice above B=32, spelled out)
LAYER_SHAPES = {"default": dict(grid="tiles", BV=64, num_warps=4, maxnreg=96, norm_heads=4),
                "tiles_BV64_w4_cap80": dict(grid="tiles", BV=64, num_warps=4, maxnreg=80, norm_heads=4),
                "tiles_BV64_w4_nocap": dict(grid="tiles", BV=64, num_warps=4, norm_heads=4)}


def step_inputs(B: int, device: str, seed: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, H, K, device=device, generator=gen).bfloat16()
    k = torch.randn(B, H, K, device=device, generator=gen).bfloat16()
    v = torch.randn(B, H, V, device=device, generator=gen).bfloat16()
    g = -5 * torch.sigmoid(torch.randn(B, H, K, device=device, generator=gen))
    beta = torch.rand(B, H, device=device, generator=gen)
    slots = torch.randperm(B + 3, generator=torch.Generator().manual_seed(seed))[:B]
    state = (torch.randn(B + 3, H, K, V, device=device, generator=gen) * 0.1).bfloat16()
    return dict(q=q, k=k, v=v, g=g, beta=beta, slots=slots.to(device=device, dtype=torch.int32), state=state)


def check(a: dict, fn) -> tuple[float, float]:
    """Output and new-state errors of ``fn(state, out)`` against one float64 step (kda_decode_ref)."""
    s64 = a["state"].double().clone()
    idx = a["slots"].long()
    ref_o = kda_decode_ref(a["q"].double(), a["k"].double(), a["v"].double(), a["g"].double(), a["beta"].double(),
                           s64, idx)
    st = a["state"].clone()
    o = torch.full_like(a["v"], float("nan"))
    fn(st, o)
    untouched = torch.ones(st.shape[0], dtype=torch.bool, device=st.device)
    untouched[idx] = False
    assert torch.equal(st[untouched], a["state"][untouched]), "a slot outside the batch changed"
    return relerr(o, ref_o), relerr(st[idx], s64[idx])


def bare_row(B: int) -> dict:
    a = step_inputs(B, "cuda", seed=B)
    q, k, v, g, beta, slots = (a[n] for n in ("q", "k", "v", "g", "beta", "slots"))
    o = torch.empty_like(v)
    res = {"B": B}
    cases = {f"dot_BV{bv}_w{w}" + (f"_cap{cap}" if cap else ""): (lambda st, out, bv=bv, w=w, cap=cap: kda_decode_launch(
        q, k, v, g, beta, st, slots, BV=bv, num_warps=w, out=out, maxnreg=cap, dot_sums=True))
        for bv, w, cap in VARIANTS}
    cases["default_bf16"] = lambda st, out: kda_decode_launch(q, k, v, g, beta, st, slots, out=out)
    for name, fn in cases.items():
        res[name + "_relerr_o"], res[name + "_relerr_state"] = check(a, fn)
        st = a["state"].clone()
        res[name + "_graph_us"] = time_graph(lambda fn=fn, st=st: fn(st, o))
    try:
        from fla.ops.kda import fused_recurrent_kda
        h0 = a["state"][slots.long()].float()
        res["fla_fp32_graph_us"] = time_graph(lambda: fused_recurrent_kda(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta.bfloat16().unsqueeze(1),
            scale=K**-0.5, initial_state=h0, output_final_state=True))
    except ImportError as exc:
        res["fla_error"] = repr(exc)
    for key in [n for n in res if n.endswith("_graph_us")]:
        res[key.replace("_graph_us", "_frac_copy")] = B * H * K * V * 2 * 2 / res[key] / 1e3  # GB/s
    return res


def layer_row(B: int) -> dict:
    from kda_decode import layer_inputs, layer_reference, time_layer_variant

    a = layer_inputs(B, torch.bfloat16, seed=B + 2)
    ref = layer_reference(a)
    res = {"B": B}
    for dot in (False, True):
        for shape, launch in LAYER_SHAPES.items():
            time_layer_variant(res, ("dot_" if dot else "plain_") + shape,
                               lambda launch=launch, dot=dot, **x: kda_layer_decode_launch(**x, **launch,
                                                                                           dot_sums=dot), a, ref, B, 2)
    return res


def main() -> int:
    return part_main(__doc__, "kda_decode_dot_sums", {"bare": bare_row, "layer": layer_row})


if __name__ == "__main__":
    raise SystemExit(main())
