"""KDA and conv kernels on a CUDA device at real sizes (H=64, K=V=128), against float64 references, and the
precision of the state chain: a plain bf16 (v3) or tf32 (v2) product there is measurably worse than bf16x3
or tf32x3."""

import itertools

import pytest
import torch

from flashinfra.kernels.kda import decode_recurrence as kda_decode, prefill as kda_prefill
from flashinfra.kernels.kda import decode as layer
from flashinfra.kernels.kda.decode_prep import HEADS_OPTIONS
from flashinfra.kernels.kda.decode_stream import STREAM_VARIANTS
from flashinfra.kernels.microbatch import micro_ranges, on_two_streams
from tests.kernels import kda_cases as cases
from tests.kernels import kda_intra_cases as intra_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_v2_varlen_real_size(dtype):
    cases.prefill_varlen("cuda", [1000, 63, 1, 300], H=8, K=128, V=128, dtype=dtype, version="v2")


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_prefill_v2_gated_real_size(lower_bound):
    cases.prefill_varlen("cuda", [777, 64], H=4, K=128, V=128, dtype=torch.bfloat16, gated=True,
                         lower_bound=lower_bound, version="v2")


@pytest.mark.parametrize("launch", [dict(BT=32), dict(BV=32), dict(BV=128, num_warps=4), dict(chain_precision="ieee"),
                                    dict(num_warps=4, num_stages=3)])
def test_prefill_v2_variants(launch):
    cases.prefill_varlen("cuda", [517, 20], H=2, K=128, V=128, dtype=torch.bfloat16, version="v2", **launch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_v3_varlen_real_size(dtype):
    cases.prefill_varlen("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, V=128, dtype=dtype, version="v3")


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_prefill_v3_gated_real_size(lower_bound):
    cases.prefill_varlen("cuda", [777, 64], H=4, K=128, V=128, dtype=torch.bfloat16, gated=True,
                         lower_bound=lower_bound, version="v3")


@pytest.mark.parametrize("launch", [dict(BV=32), dict(BV=32, out_x3=True), dict(solve_precision="tf32"),
                                    dict(solve_precision="tf32x3"), dict(b_precision="bf16x3"),
                                    dict(b_warps=8), dict(BV=32, num_warps=8)])
def test_prefill_v3_variants(launch):
    cases.prefill_varlen("cuda", [517, 20], H=2, K=128, V=128, dtype=torch.bfloat16, version="v3", **launch)


@pytest.mark.parametrize("launch", [dict(KS=16, d_warps=1), dict(a_ks=32, a_stages=3), dict(b_block=64),
                                    dict(b_block=16), dict(b_value_block=32), dict(b_value_block=128), dict(b_warps=2),
                                    dict(b_stages=2), dict(b_stages=4, b_block=64), dict(b_stages=1, row_pad=1),
                                    dict(a_stages=1), dict(a_stages=3, a_ks=16),
                                    dict(num_stages=2), dict(gate_block=32, gate_warps=1),
                                    dict(gate_block=128, gate_warps=4), dict(u_in_state=True),
                                    dict(u_in_state=True, chain_precision="bf16x2"),
                                    dict(u_in_state=True, state_l2_ahead=0), dict(d_maxnreg=128), dict(d_warps=4),
                                    dict(u_in_state=False, KS=16), dict(b_maxnreg=96),
                                    dict(d_maxnreg=None), dict(w_in_state=False),
                                    dict(w_in_state=False, chain_precision="bf16x2"),
                                    dict(w_in_state=False, d_maxnreg=None)])
def test_prefill_v3_split_variants(launch):
    cases.prefill_varlen("cuda", [517, 20], H=2, K=128, V=128, dtype=torch.bfloat16, version="v3", decay=0.3,
                         **launch)


@pytest.mark.parametrize("dtype,decay", [(torch.bfloat16, 0.1), (torch.bfloat16, 5.0), (torch.float32, 5.0)])
def test_prefill_v3_split_real_size(dtype, decay):
    """v3 (the gate pass, kda_prefill_gate.py; in-chunk matrices in kda_prefill_intra64_split.py and
    kda_prefill_intra64_rows.py); slow decay makes the products between a chunk's far sub-blocks matter."""
    cases.prefill_varlen("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, V=128, dtype=dtype, version="v3",
                         decay=decay)


@pytest.mark.parametrize("lower_bound,decay", [(-5.0, 5.0), (-0.3, 0.1), (None, 5.0), (None, 0.2)])
def test_prefill_v3_split_gated_real_size(lower_bound, decay):
    cases.prefill_varlen("cuda", [777, 64, 1], H=8, K=128, V=128, dtype=torch.bfloat16, gated=True,
                         lower_bound=lower_bound, version="v3", decay=decay)


@pytest.mark.parametrize("gated,lower_bound,decay,a_lo,kg", [
    (False, -5.0, 0.1, True, False), (True, -5.0, 0.5, True, False), (False, -5.0, 5.0, False, False),
    (True, -5.0, 5.0, False, False), (False, -5.0, 0.1, False, True), (True, -5.0, 5.0, False, True)])
def test_intra_d_real_size(gated, lower_bound, decay, a_lo, kg):
    """Kernel D alone against float64 with its scratch poisoned (kda_intra_cases.intra_d): the diagonal blocks of Aqk
    and Ai, Aqk's zeros above them and the state pass's qg and kd (with ``kg``, -kg and exp(gl) too), at the
    launcher's two warps, K slices of 32 and tf32 products."""
    intra_cases.intra_d("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, dtype=torch.bfloat16, gated=gated,
                        lower_bound=lower_bound, decay=decay, KS=32, num_warps=2, precision="tf32", a_lo=a_lo, kg=kg)


@pytest.mark.parametrize("gated,lower_bound,decay,precision,solve", [
    (False, -5.0, 0.1, "tf32", None), (False, -5.0, 5.0, "ieee", None), (True, -5.0, 0.5, "tf32", None),
    (True, None, 0.2, "tf32", None), (False, -5.0, 5.0, "ieee", "bf16x3"), (True, -5.0, 0.1, "ieee", "bf16x3")])
def test_intra_a_real_size(gated, lower_bound, decay, precision, solve):
    """Kernel A alone against float64 with its scratch poisoned (kda_intra_cases.intra_a), reading the gate pass's
    scratch: the off-diagonal blocks of Aqk and L and the merged inverse, at the launcher's one warp and K
    slices of 16."""
    intra_cases.intra_a("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, dtype=torch.bfloat16, gated=gated,
                  lower_bound=lower_bound, decay=decay, KS=16, num_warps=1, precision=precision, solve=solve)


@pytest.mark.parametrize("gated,lower_bound,decay,g_dtype", [(False, -5.0, 5.0, torch.float32),
                                                             (True, -5.0, 5.0, torch.bfloat16),
                                                             (True, None, 50.0, torch.bfloat16)])
def test_gate_pass_scratch_real_size(gated, lower_bound, decay, g_dtype):
    """The gate pass alone against float64, scratch poisoned (kda_intra_cases.gate_scratch); the last case at the
    -10 clamp."""
    intra_cases.gate_scratch("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, gated=gated, lower_bound=lower_bound,
                       decay=decay, g_dtype=g_dtype)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 64, 67])
def test_decode_real_size(B, state_dtype):
    """The launcher's own configuration (``recurrence_config``) per batch size and state dtype."""
    cases.decode("cuda", B=B, H=64, K=128, V=128, dtype=torch.bfloat16, state_dtype=state_dtype)


@pytest.mark.parametrize("state_dtype,dot_sums", [(torch.float32, None), (torch.bfloat16, None),
                                                  (torch.bfloat16, False)])
@pytest.mark.parametrize("BV,num_warps,maxnreg", [(32, 4, None), (16, 1, None), (64, 4, 96), (128, 8, None)])
def test_decode_variants(BV, num_warps, maxnreg, state_dtype, dot_sums):
    """Block shapes of the bare recurrence; for a bf16 state with the step's sums on the tensor cores (the
    configuration's) and on the CUDA cores."""
    cases.decode("cuda", B=9, H=64, K=128, V=128, dtype=torch.bfloat16, state_dtype=state_dtype, BV=BV,
                 num_warps=num_warps, maxnreg=maxnreg, dot_sums=dot_sums)


@pytest.mark.parametrize("B,BV,num_warps", [(9, 64, 4), (67, 32, 2), (9, 128, 8), (1, 64, 4)])
def test_decode_dot_sums_real_size(B, BV, num_warps):
    """The bf16 state's sums over K as one tensor-core product (``dot_sums``), bare and in the layer's tiles
    kernel (with [K, 128] tiles: the norm in the state kernel)."""
    cases.decode("cuda", B=B, H=64, K=128, V=128, dtype=torch.bfloat16, state_dtype=torch.bfloat16, BV=BV,
                 num_warps=num_warps, dot_sums=True)
    cases.layer_decode("cuda", B=B, H=64, K=128, state_dtype=torch.bfloat16, dtype=torch.bfloat16, grid="tiles",
                       BV=BV, num_warps=num_warps, dot_sums=True)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 2, 33, 67])
def test_layer_decode_real_size(B, state_dtype):
    """The configuration ``decode_config`` picks for B."""
    cases.layer_decode("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16)


def _table_configs() -> list[tuple[torch.dtype, dict]]:
    """Every configuration the launcher can choose, over batch sizes up to 4096 and both state dtypes."""
    seen = {}
    for dt in (torch.float32, torch.bfloat16):
        for B in [2**i for i in range(13)]:
            for b in (B - 1, B, B + 1):
                cfg = layer.decode_config(max(b, 1), dt)
                seen[(dt, tuple(sorted(cfg.items())))] = cfg
    return list(seen.items())


@pytest.mark.parametrize("key_cfg", _table_configs(),
                         ids=lambda kc: "-".join([str(kc[0][0])[6:], *(f"{k}{v}" for k, v in kc[1].items())]))
def test_layer_decode_every_table_config(key_cfg):
    (state_dtype, _), cfg = key_cfg
    cases.layer_decode("cuda", B=9, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16, **cfg)


# every (grid, BV, num_warps) of the one-shot layouts that bench/kda_decode.py times, and whole-row blocks
LAYOUTS = [("block", 16, 1), ("block", 16, 2), ("block", 16, 4), ("block", 32, 2), ("block", 32, 4), ("block", 64, 4),
           ("block", 128, 8), ("prep", 16, 2), ("prep", 32, 2), ("prep", 32, 4), ("prep", 64, 4)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grid,BV,num_warps", LAYOUTS)
def test_layer_decode_layout_variants(grid, BV, num_warps, state_dtype):
    cases.layer_decode("cuda", B=9, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16, grid=grid, BV=BV,
                       num_warps=num_warps)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grid,BV,num_warps,launch", STREAM_VARIANTS,
                         ids=lambda x: f"{x}" if not isinstance(x, dict) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_layer_decode_stream_variants(grid, BV, num_warps, launch, state_dtype):
    """B=9: 2304 (BV 32) tiles over a grid of as many programs as fit on the SMs, so most walk several tiles
    and some one fewer than others; BV 128: one tile per head, the gated RMSNorm in the state kernel."""
    cases.layer_decode("cuda", B=9, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16, grid=grid, BV=BV,
                       num_warps=num_warps, **launch)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,launch", [(1, {}), (67, {}), (33, dict(programs=7)), (33, dict(per_sm=1)),
                                      (67, dict(BV=128, num_warps=4, num_stages=2)), (67, dict(tma_store=False)),
                                      (67, dict(prep_warps=1, norm_warps=1)), (67, dict(prep_warps=2, norm_warps=2))])
@pytest.mark.parametrize("grid", ["stream", "tiles"])
def test_layer_decode_stream_sizes(grid, B, launch, state_dtype):
    """One tile per program (B=1), many (B=67, or a grid of 7 programs), one program per SM."""
    if (grid != "stream" and ("tma_store" in launch or "BV" in launch)) or (
            grid == "tiles" and ("programs" in launch or "per_sm" in launch)):
        pytest.skip("an option of the descriptor loop or of the persistent grid")
    launch = {"BV": 32, "num_warps": 2, **launch}
    cases.layer_decode("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16, grid=grid, **launch)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [dict(grid="prep", BV=64, num_warps=4), dict(grid="tiles", BV=64, num_warps=4),
                                    dict(grid="stream", BV=32, num_warps=2)], ids=lambda d: d["grid"])
@pytest.mark.parametrize("heads", HEADS_OPTIONS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_layer_decode_prep_heads(heads, layout, state_dtype):
    """The prep and norm launches with several heads per program (the benchmarked options) under the layouts
    that have a prep launch, at B=67 (an odd batch, the last programs' sequences) and B=1."""
    for B in (67, 1):
        cases.layer_decode("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16, **layout, **heads)


PDL_LAYOUTS = [dict(grid="block", BV=32, num_warps=2)]  # the layout with pdl (B=1's)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", PDL_LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_layer_decode_pdl(layout, state_dtype):
    """The block layout's norm launch as a programmatic dependent of its state launch."""
    for B in (67, 1):
        cases.layer_decode("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16, pdl=True, **layout)


GRAPH_STEP_CASES = [(33, torch.float32, dict(pdl=True, **PDL_LAYOUTS[0])),  # the dependent norm launch
                    (67, torch.float32, {}), (67, torch.bfloat16, {}),  # the defaults: two micro-batches
                    (67, torch.bfloat16, dict(grid="tiles", BV=64, num_warps=4, micro_batches=3))]


@pytest.mark.parametrize("B,state_dtype,launch", GRAPH_STEP_CASES,
                         ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_layer_decode_graph_steps(B, state_dtype, launch, monkeypatch):
    """Three decode steps replayed from one CUDA graph: each step's launches must see the previous step's state
    and conv slot (after a dependent norm launch has ended; after both streams of the micro-batches have joined);
    each step's output is checked. The row ranges launched are recorded: the configuration's micro-batches
    only inside the capture."""
    H, K, steps = 64, 128, 3
    ranges = []

    def recorded(rs, launch_rows, device):
        ranges.append(rs)
        on_two_streams(rs, launch_rows, device)

    monkeypatch.setattr(layer, "on_two_streams", recorded)
    a = cases.layer_decode_inputs("cuda", B=B, H=H, K=K, state_dtype=state_dtype, dtype=torch.bfloat16)
    r = {n: (t.double().clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in a.items()}
    out = torch.empty((B, H, K), dtype=torch.bfloat16, device="cuda")
    layer.kda_layer_decode_launch(**{**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()},
                                  out=out, **launch)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.kda_layer_decode_launch(**a, out=out, **launch)
    # a caller's own layout takes none of the configuration's options, micro-batches included
    default = 1 if "grid" in launch else layer.decode_config(B, state_dtype).get("micro_batches", 1)
    eager, captured = launch.get("micro_batches", 1), launch.get("micro_batches", default)
    assert ranges == [micro_ranges(B, n) for n in (eager, captured) if n > 1], "the row ranges of the two calls"
    rel, atol, rtol = cases.tolerances(torch.bfloat16, "cuda")
    for _ in range(steps):
        out.fill_(float("nan"))
        graph.replay()
        ref = layer.kda_layer_decode_ref(**r)
        torch.cuda.synchronize()
        cases.assert_close("o", out, ref, rel, atol, rtol)
    cases.assert_close("state", a["state"], r["state"], 4e-3, 1e-2, 1e-2)
    assert torch.equal(a["conv_state"].double(), r["conv_state"]), "conv state differs from the reference shift"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,micro_batches", [(67, 2), (67, 4), (64, 3), (9, 2)])
def test_layer_decode_micro_batches_match(B, micro_batches, state_dtype):
    """Micro-batches on two streams give the single launch's output and states bit for bit (the same kernels
    on disjoint rows and slots), eager, at the configuration for the whole batch."""
    a = cases.layer_decode_inputs("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16)
    results = []
    for n in (1, micro_batches):
        x = {**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()}
        out = torch.full((B, 64, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.kda_layer_decode_launch(**x, out=out, micro_batches=n)
        results.append((out, x["conv_state"], x["state"]))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads", HEADS_OPTIONS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_layer_decode_prep_heads_fp32_activations(heads):
    for grid in ("prep", "tiles"):
        cases.layer_decode("cuda", B=5, H=64, K=128, dtype=torch.float32, grid=grid, **heads)


@pytest.mark.parametrize("grid", ["block", "prep", "stream", "tiles"])
def test_layer_decode_fp32_activations(grid):
    cases.layer_decode("cuda", B=5, H=64, K=128, dtype=torch.float32, grid=grid)


def test_conv_real_size():
    cases.conv_prefill("cuda", [1000, 63, 1], C=3 * 64 * 128, dtype=torch.bfloat16)
    cases.conv_decode("cuda", B=65, C=3 * 64 * 128, dtype=torch.bfloat16)


def test_public_ops_dispatch_to_triton_on_cuda():
    """On CUDA the public ops run the kernels: a bad argument raises the launcher's error."""
    q = torch.randn(3, 2, 16, device="cuda")
    state = torch.zeros(2, 2, 16, 16, device="cuda")
    with pytest.raises(ValueError, match="state slots must be distinct"):
        kda_prefill.kda_prefill(q, q, q, -torch.rand(3, 2, 16, device="cuda"), torch.rand(3, 2, device="cuda"),
                                state, [0, 1, 3], [0, 0], [False, False])
    with pytest.raises(ValueError, match="shapes disagree"):
        kda_decode.kda_decode(q, q, q, -torch.rand(3, 2, 8, device="cuda"), torch.rand(3, 2, device="cuda"), state,
                              torch.tensor([0, 1, 0], device="cuda"))


def test_v2_plain_tf32_state_chain_is_worse_than_tf32x3():
    """Slow decay (long memory), T=16384, in-chunk products in tf32x3 so that only the state chain differs:
    the final state's error against float64 with the chain in plain tf32 is many times that with tf32x3
    (which stays near fp32 rounding)."""
    T, H, K = 16384, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen) for _ in range(3))
    g = -0.02 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    s64 = torch.zeros(1, H, K, K, dtype=torch.float64, device="cuda")
    ref = kda_prefill.kda_prefill_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), s64, [0, T],
                                      [0], [False])
    errs = {}
    for prec in ("tf32", "tf32x3"):
        s = torch.full((1, H, K, K), float("nan"), device="cuda")
        o = kda_prefill.kda_prefill_launch(q, k, v, g, beta, s, [0, T], [0], [False], chain_precision=prec,
                                           local_precision="tf32x3", version="v2")
        errs[prec] = (float((s.double() - s64).norm() / s64.norm()), float((o.double() - ref).norm() / ref.norm()))
    assert errs["tf32x3"][0] < 1e-4, errs
    assert errs["tf32"][0] > 5 * errs["tf32x3"][0], errs


@pytest.mark.parametrize("dtype,decay", [(torch.bfloat16, 0.1), (torch.bfloat16, 5.0), (torch.float32, 0.1)])
def test_prefill_v3_x2_real_size(dtype, decay):
    """The bf16x2 state chain (w and kd one bf16 each, 3 scratch slots)."""
    cases.prefill_varlen("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, V=128, dtype=dtype, version="v3",
                         chain_precision="bf16x2", decay=decay)


@pytest.mark.parametrize("lower_bound,decay", [(-5.0, 5.0), (None, 0.2)])
def test_prefill_v3_x2_gated_real_size(lower_bound, decay):
    cases.prefill_varlen("cuda", [777, 64], H=4, K=128, V=128, dtype=torch.bfloat16, gated=True,
                         lower_bound=lower_bound, version="v3", chain_precision="bf16x2", decay=decay)


@pytest.mark.parametrize("launch", [dict(out_x3=True, BV=32), dict(BV=128, num_warps=8)])
def test_prefill_v3_x2_variants(launch):
    cases.prefill_varlen("cuda", [517, 20], H=2, K=128, V=128, dtype=torch.bfloat16, version="v3",
                         chain_precision="bf16x2", decay=0.3, **launch)


def _final_state_f64(q, k, v, g, beta):
    """The final state of one sequence from zero, computed in float64 throughout (``kda_prefill_ref`` casts
    its inputs to float32, which at these lengths is no longer far below the errors compared here)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    s0 = torch.zeros(H, K, V, dtype=torch.float64, device=q.device)
    _, s = kda_prefill.kda_chunk_one_ref(kda_prefill.l2norm_ref(q), kda_prefill.l2norm_ref(k), v, g, beta, s0)
    return s[None]


def test_v3_state_chain_precisions():
    """v3's state chains at T=16384 with slow decay (log-decay -0.02 sigmoid(x)), in-chunk products in tf32x3
    so that only the chain differs, final state against float64. bench/kda_chain_emulation.py predicted, with
    the kernel's roundings (T=16384, H=1): bf16x3 5.0e-6, bf16x2 1.9e-3, plain bf16 2.6e-3. bf16x3 stays
    near fp32 rounding; bf16x2 sits at one bf16 rounding of kd (and w), which enters every chunk's update of
    S but does not compound (the state keeps 16 bits), so it is bounded below plain bf16, and it is not
    close to bf16x3."""
    T, H, K = 16384, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen) for _ in range(3))
    g = -0.02 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    s64 = _final_state_f64(q, k, v, g, beta)
    errs = {}
    for prec in ("bf16", "bf16x2", "bf16x3"):
        s = torch.full((1, H, K, K), float("nan"), device="cuda")
        kda_prefill.kda_prefill_launch(q, k, v, g, beta, s, [0, T], [0], [False], chain_precision=prec,
                                       local_precision="tf32x3", version="v3")
        errs[prec] = float((s.double() - s64).norm() / s64.norm())
    print("final-state relative error against float64:", errs)
    assert errs["bf16x3"] < 1e-4, errs
    assert errs["bf16"] > 5 * errs["bf16x3"], errs
    assert 9e-4 < errs["bf16x2"] < 4e-3 and errs["bf16x2"] < errs["bf16"], errs


@pytest.mark.parametrize("chain", ["bf16x3", "bf16x2"])
def test_prefill_v3_state_l2_prefetch_changes_nothing(chain):
    """The state pass's L2 prefetch (``state_l2_ahead``: one, two or no steps ahead) moves nothing into the program:
    outputs and final states bitwise those without it, in a packed batch with empty and one-token sequences."""
    lens, H = [1000, 0, 1, 300, 64, 129], 4
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(T, H, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(T, H, 128, device="cuda", generator=gen))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    s0 = torch.randn(len(lens), H, 128, 128, device="cuda", generator=gen)
    cu = [0] + list(itertools.accumulate(lens))
    got = []
    for ahead in (0, 1, 2):
        s = s0.clone()
        o = kda_prefill.kda_prefill_launch(q, k, v, g, beta, s, cu, list(range(len(lens))), [True] * len(lens),
                                           chain_precision=chain, version="v3", state_l2_ahead=ahead)
        got.append((o, s))
    for o, s in got[1:]:
        assert torch.equal(o, got[0][0]) and torch.equal(s, got[0][1])


def test_tiny_model_greedy_tokens_same_with_kernels_and_references(tmp_path, monkeypatch):
    cases.tiny_model_greedy_same(tmp_path, monkeypatch, "cuda")
