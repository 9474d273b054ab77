"""The KDA and conv Triton kernels run by Triton's CPU interpreter at small sizes. Collected only through
``test_kda_interpret.py``, which runs this file in a subprocess with ``TRITON_INTERPRET=1`` (the variable
must be set before Triton compiles anything, and must not leak into the rest of the suite)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from flashinfra.kernels.kda import decode_recurrence as kda_decode, prefill as kda_prefill
from flashinfra.kernels.kda import decode as layer_decode
from tests.kernels import kda_cases as cases
from tests.kernels import kda_intra_cases as intra_cases


@pytest.mark.parametrize("lens", [[63], [1, 17, 40, 2], [33, 16], [5, 0, 3]])
def test_prefill_varlen(lens):
    cases.prefill_varlen("cpu", lens, H=2, K=16, V=32, BV=16, version="v2")


def test_prefill_long_odd():
    cases.prefill_varlen("cpu", [1000], H=1, K=16, V=16, seed=3, version="v2")


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_prefill_gated(lower_bound):
    cases.prefill_varlen("cpu", [21, 50], H=2, K=32, V=16, gated=True, lower_bound=lower_bound, seed=1, version="v2")


def test_prefill_chunk32_and_ieee_chain():
    cases.prefill_varlen("cpu", [70, 5], H=1, K=16, V=16, BT=32, chain_precision="ieee", seed=2,
                         version="v2")


@pytest.mark.parametrize("lens", [[63], [1, 17, 70, 2], [5, 0, 129]])
def test_prefill_v3_varlen(lens):
    cases.prefill_varlen("cpu", lens, H=2, K=16, V=32, BV=16, version="v3", out_x3=True)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_prefill_v3_gated(lower_bound):
    cases.prefill_varlen("cpu", [21, 130], H=2, K=32, V=16, gated=True, lower_bound=lower_bound, seed=1,
                         version="v3", out_x3=True)


@pytest.mark.parametrize("lens,kw", [
    ([1, 100, 37], dict(decay=0.1, b_block=16)),  # slow decay: the far sub-blocks' products matter; B in
    # two column blocks
    ([63, 5, 0, 129], dict(KS=16, d_warps=1)),  # D in two K slices, an empty sequence, a one-token chunk
    ([63, 5, 0, 129], dict(a_ks=16, a_stages=3, decay=0.5)),  # A in two K slices of 16, three deep
    ([21, 130], dict(gated=True, lower_bound=-0.3, decay=0.1, b_block=16)),
    ([21, 130], dict(gated=True, lower_bound=-5.0, decay=0.3)),
    ([77, 3], dict(gated=True, lower_bound=None, decay=0.2)),
    ([1, 100, 37], dict(decay=0.1)),  # the default options; a one-token sequence
    ([37, 64, 0], dict(decay=0.1)),  # an empty last sequence (its chunk offset is the end of the scratch)
    ([21, 130], dict(gated=True, lower_bound=-5.0, decay=0.5)),
    # B in two key and two value blocks, each loaded a block ahead
    ([1, 70, 33], dict(V=32, b_block=16, b_value_block=16, decay=0.3)),
    ([21, 130], dict(gated=True, lower_bound=-5.0, decay=0.3, solve_precision="tf32x3")),  # A's merge in tf32x3
    ([1, 70, 33], dict(V=32, b_block=16, b_value_block=16, decay=0.1, b_precision="bf16x3")),  # B's products in bf16x3
    # B's value blocks wider than its key blocks (the default's 32 and 64 at K=V=128): two of each
    ([1, 70, 33], dict(K=32, V=64, BV=32, b_block=16, b_value_block=32, decay=0.3)),
    # B's column loops unpipelined; q, k and v rows 8 elements longer (a 16-byte multiple: read in place) and 1
    # longer (copied first for the copy engine); rows past each sequence's end
    ([1, 70, 33, 0, 5], dict(K=32, V=64, BV=32, b_block=16, b_value_block=32, decay=0.3, b_stages=1, row_pad=8)),
    ([1, 70, 33, 0, 5], dict(K=32, V=64, BV=32, b_block=16, b_value_block=32, decay=0.3, row_pad=1)),
    # the gate pass in two column blocks of 16, on two warps
    ([21, 130], dict(gated=True, lower_bound=-5.0, decay=0.5, gate_block=16, gate_warps=2)),
    # u formed in the state pass from v and Aib (bf16 v), and w's product too (w_in_state, its default there: no
    # kernel B): slow decay, empty and one-token sequences, padded rows
    ([1, 100, 0, 37], dict(decay=0.1, u_in_state=True, out_x3=False, dtype=torch.bfloat16)),
    ([1, 100, 0, 37], dict(decay=0.1, u_in_state=True, w_in_state=False, out_x3=False, dtype=torch.bfloat16)),
    ([1, 70, 33, 0, 5], dict(K=32, V=64, BV=32, decay=0.3, row_pad=8, u_in_state=True, out_x3=False,
                             dtype=torch.bfloat16)),
    ([1, 70, 33, 0, 5], dict(K=32, V=64, BV=32, decay=0.3, row_pad=8, u_in_state=True, w_in_state=False,
                             out_x3=False, dtype=torch.bfloat16, chain_precision="bf16x2")),
    ([21, 130], dict(gated=True, lower_bound=-5.0, decay=0.3, u_in_state=True, out_x3=False, dtype=torch.bfloat16,
                     chain_precision="bf16x2")),
])
def test_prefill_v3_split(lens, kw):
    """v3's gate pass (kda_prefill_gate.py), in-chunk matrices (kernel D, kda_prefill_intra64_split.py; kernel
    A per 16-row block, one K slice of 32 here by default, kda_prefill_intra64_rows.py) and tiles
    (kda_prefill_intra64_b.py) at their options; out_x3 keeps the interpreter's bf16 truncation of qg out of the
    comparison."""
    cases.prefill_varlen("cpu", lens, **{"H": 2, "K": 32, "V": 16, "seed": 4, "version": "v3", "out_x3": True, **kw})


@pytest.mark.parametrize("lens,kw", [
    ([70, 1, 0, 64, 129], dict(decay=0.1, KS=16)),  # slow decay; an empty sequence, one-token chunks; two K slices
    ([70, 33], dict(gated=True, lower_bound=-5.0, decay=0.5)),
    ([70, 33], dict(decay=0.5, a_lo=False, num_warps=1)),  # Aqk's hi half alone (the bf16x2 launch's)
    ([70, 1, 0, 64, 129], dict(gated=True, lower_bound=-5.0, decay=0.5, a_lo=False)),
    # -kg and exp(gl) in kernel B's place (w_in_state)
    ([70, 1, 0, 64, 129], dict(gated=True, lower_bound=-5.0, decay=0.5, a_lo=False, kg=True)),
    ([70, 33], dict(decay=0.1, KS=16, a_lo=False, kg=True)),
])
def test_prefill_v3_intra_d(lens, kw):
    """Kernel D alone against float64, reading the gate pass's scratch, its own poisoned: the diagonal blocks
    and Aqk's zeros above them (kda_intra_cases.intra_d)."""
    intra_cases.intra_d("cpu", lens, H=2, K=32, **kw)


@pytest.mark.parametrize("lens,kw", [
    ([70, 1, 0, 64, 129], dict(decay=0.1)),  # slow decay; an empty sequence, one-token chunks; two K slices
    ([70, 33], dict(gated=True, lower_bound=-5.0, decay=0.5, num_warps=2)),
    ([70, 33], dict(gated=True, lower_bound=None, decay=0.3, KS=32)),  # one K slice
    ([70, 1, 0, 64, 129], dict(gated=True, lower_bound=None, decay=0.3)),  # one-token chunks, gated
    ([70, 33], dict(decay=0.5, a_lo=False)),  # Aqk's hi half alone (the default launch's)
    ([70, 1, 0, 64, 129], dict(decay=0.1, solve="bf16x3")),  # the merge in three bf16 products
    ([70, 33], dict(gated=True, lower_bound=-5.0, decay=5.0, solve="bf16x3")),
    ([70, 1, 0, 64, 129], dict(decay=0.1, stages=1)),  # the slices unpipelined
])
def test_prefill_v3_intra_a(lens, kw):
    """Kernel A alone against float64, reading the gate pass's scratch, its own poisoned
    (kda_intra_cases.intra_a)."""
    intra_cases.intra_a("cpu", lens, H=2, K=32, **kw)


@pytest.mark.parametrize("lens,kw", [
    ([1, 100, 0, 37], dict(K=64, BK=32, num_warps=1)),  # two column blocks (beta from the first); an empty sequence
    ([1, 100, 0, 37], dict(K=64)),  # the launcher's shape: one block of 64 on two warps
    ([21, 130], dict(K=32, gated=True, lower_bound=-5.0, decay=0.5)),
    ([77, 3], dict(K=32, gated=True, lower_bound=None, decay=50.0, g_dtype=torch.bfloat16)),  # the -10 clamp
])
def test_gate_pass_scratch(lens, kw):
    """The gate pass alone against float64, scratch poisoned (kda_intra_cases.gate_scratch)."""
    intra_cases.gate_scratch("cpu", lens, H=2, **kw)


@pytest.mark.parametrize("lens,kw", [
    ([1, 100, 37], dict(out_x3=True)),  # w, qg, qg lo, kd: 4 slots; Aqk lo
    ([63, 5, 0, 129], dict(decay=0.1)),  # w, qg, kd: 3 slots
    ([21, 130], dict(gated=True, lower_bound=-5.0, out_x3=True, decay=0.5)),
])
def test_prefill_v3_chain_bf16x2(lens, kw):
    """w and kd as one bf16 each (S and v' still split): tolerances of a bf16 input rounding (kda_cases);
    slow decay, where the plain bf16 chain exceeds them."""
    cases.prefill_varlen("cpu", lens, H=2, K=32, V=16, seed=4, version="v3", chain_precision="bf16x2", **kw)


def _chain_emulation():
    path = Path(__file__).resolve().parents[2] / "bench" / "kda_chain_emulation.py"
    spec = importlib.util.spec_from_file_location("kda_chain_emulation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("chain", ["bf16x3", "bf16x2"])
def test_prefill_v3_chain_matches_its_emulation(chain):
    """The state pass applies its bf16 roundings where bench/kda_chain_emulation.py (which predicts the chains'
    precision at long T) applies them: at K=V=128 the kernel's final state is within 1e-4 of its own chain's
    emulation (float32 in-chunk values against float64 ones rounded), and 100x farther from the other chains'."""
    emu = _chain_emulation()
    T = 256
    q, k, v, g, beta = emu.inputs(T, "chain_test")
    t = emu.in_chunk(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    s = torch.full((1, 1, 128, 128), float("nan"))
    kda_prefill.kda_prefill_launch(q.float(), k.float(), v.float(), g.float(), beta.float(), s, [0, T], [0], [False],
                                   chain_precision=chain, local_precision="ieee", version="v3", BV=64)
    dist = {m: emu.rel(s[0, 0].double(), emu.chain(t, m, truncate=True)[1]) for m in ("bf16x3", "bf16x2", "bf16")}
    others = min(d for m, d in dist.items() if m != chain)
    assert dist[chain] < 1e-4 and dist[chain] * 100 < others, dist


def test_prefill_v3_bad_options():
    q = torch.randn(70, 1, 16)
    args = (q, q, q, -torch.rand(70, 1, 16), torch.rand(70, 1), torch.zeros(1, 1, 16, 16), [0, 70], [0], [False])
    with pytest.raises(ValueError, match="KS must be a power of two"):
        kda_prefill.kda_prefill_launch(*args, version="v3", KS=24)
    with pytest.raises(ValueError, match="b_block must be a power of two"):
        kda_prefill.kda_prefill_launch(*args, version="v3", b_block=8)
    with pytest.raises(ValueError, match="a_ks must be a power of two"):
        kda_prefill.kda_prefill_launch(*args, version="v3", a_ks=24)
    with pytest.raises(ValueError, match="out_x3 needs BV <= 32"):
        kda_prefill.kda_prefill_launch(q, q, torch.randn(70, 1, 64), *args[3:5], torch.zeros(1, 1, 16, 64),
                                       *args[6:], version="v3", out_x3=True, BV=64)
    with pytest.raises(ValueError, match="chain_precision must be one of"):
        kda_prefill.kda_prefill_launch(*args, version="v3", chain_precision="bf16x4")
    with pytest.raises(ValueError, match="b_maxnreg must be None or in"):
        kda_prefill.kda_prefill_launch(*args, version="v3", b_maxnreg=16)
    with pytest.raises(ValueError, match="d_maxnreg must be None or in"):
        kda_prefill.kda_prefill_launch(*args, version="v3", d_maxnreg=300)
    with pytest.raises(ValueError, match="solve_precision must be one of"):
        kda_prefill.kda_prefill_launch(*args, version="v3", solve_precision="bf16x2")
    with pytest.raises(ValueError, match="b_stages must be >= 1"):
        kda_prefill.kda_prefill_launch(*args, version="v3", b_stages=0)
    with pytest.raises(ValueError, match="a_stages must be >= 1"):
        kda_prefill.kda_prefill_launch(*args, version="v3", a_stages=0)
    with pytest.raises(ValueError, match="b_precision"):
        kda_prefill.kda_prefill_launch(*args, version="v3", b_precision="fp8")
    with pytest.raises(ValueError, match="gate_warps must be"):
        kda_prefill.kda_prefill_launch(*args, version="v3", gate_warps=3)
    with pytest.raises(ValueError, match="gate_block must be"):
        kda_prefill.kda_prefill_launch(*args, version="v3", gate_block=48)
    # u formed in the state pass needs bf16 v and a 16-bit output (float32 q gives a float32 output here)
    with pytest.raises(ValueError, match="u_in_state needs bf16 v"):
        kda_prefill.kda_prefill_launch(*args, version="v3", u_in_state=True)
    with pytest.raises(ValueError, match="u_in_state needs bf16 v"):
        kda_prefill.kda_prefill_launch(q, q, q.bfloat16(), *args[3:], version="v3", u_in_state=True)
    with pytest.raises(ValueError, match="w_in_state needs u_in_state"):
        kda_prefill.kda_prefill_launch(*args, version="v3", w_in_state=True)


def test_prefill_v3_long_odd():
    cases.prefill_varlen("cpu", [333], H=1, K=16, V=16, seed=3, version="v3", out_x3=True)


@pytest.mark.parametrize("state_dtype,launch", [(torch.float32, dict(BV=16)), (torch.bfloat16, {}),
                                                (torch.float32, dict(BV=64, num_warps=2)),
                                                (torch.bfloat16, dict(dot_sums=False)),
                                                (torch.bfloat16, dict(dot_sums=False, BV=64)),
                                                (torch.bfloat16, dict(dot_sums=True, BV=16, num_warps=2))])
def test_decode(state_dtype, launch):
    """The bare recurrence: V=32 over two programs of 16 columns, the default configuration (bf16 state: the sums
    over K as a tensor-core product, ``dot_sums``), one block wider than V (masked columns), and the bf16 step on
    the CUDA cores."""
    cases.decode("cpu", B=5, H=3, K=16, V=32, state_dtype=state_dtype, **launch)


def test_decode_dot_sums_padded_k_and_bad_options():
    """``dot_sums`` with K=24 (the block's rows padded to 32 with zeros), and its refusals."""
    cases.decode("cpu", B=4, H=2, K=24, V=32, state_dtype=torch.bfloat16, dot_sums=True)
    with pytest.raises(ValueError, match="dot_sums needs a bfloat16 state"):
        cases.decode("cpu", B=2, H=1, K=16, V=16, dot_sums=True)
    with pytest.raises(ValueError, match="dot_sums needs K and BV of at least 16"):
        cases.decode("cpu", B=2, H=1, K=16, V=16, state_dtype=torch.bfloat16, dot_sums=True, BV=8)


@pytest.mark.parametrize("grid,state_dtype,lower_bound,K", [
    ("block", torch.float32, -5.0, 24), ("block", torch.bfloat16, None, 32),
    ("prep", torch.bfloat16, -5.0, 24), ("prep", torch.float32, None, 32),
])
def test_layer_decode(grid, state_dtype, lower_bound, K):
    """The one-shot layouts, both state dtypes, with and without the gate's lower bound; K=V=24 masks part of a
    block."""
    cases.layer_decode("cpu", B=3, H=2, K=K, state_dtype=state_dtype, lower_bound=lower_bound, grid=grid, BV=16)


@pytest.mark.parametrize("grid,state_dtype,lower_bound,K,launch", [
    ("stream", torch.float32, -5.0, 24, {}),
    ("stream", torch.bfloat16, None, 32, dict(programs=3, num_stages=3)),
    ("stream", torch.bfloat16, -5.0, 24, dict(BV=32, tma_store=False)),
    ("stream", torch.float32, None, 32, dict(BV=32, scratch_l2=True)),
    ("stream", torch.float32, None, 24, dict(programs=5)),
    ("tiles", torch.bfloat16, None, 24, dict(maxnreg=96)),
    ("tiles", torch.float32, -5.0, 32, dict(BV=8)),
    ("tiles", torch.bfloat16, -5.0, 24, dict(BV=32, prep_warps=1)),
    ("tiles", torch.float32, None, 24, dict(norm_warps=1)),
    ("tiles", torch.bfloat16, -5.0, 24, dict(dot_sums=True)),  # the sums on the tensor cores, K rows padded
    ("tiles", torch.bfloat16, None, 32, dict(BV=32, dot_sums=True)),  # a whole row: the norm in the state kernel
])
def test_layer_decode_stream(grid, state_dtype, lower_bound, K, launch):
    """The persistent layouts: 12 tiles over 4 programs by default (3 or 5 programs: uneven shares); K=V=24
    leaves rows and columns of the last tile outside the state (the descriptor's zero fill, masked plain
    stores); BV >= V: one tile per head, the gated RMSNorm in the state kernel."""
    launch = {"BV": 16, **launch}
    cases.layer_decode("cpu", B=3, H=2, K=K, state_dtype=state_dtype, lower_bound=lower_bound, grid=grid, **launch)


@pytest.mark.parametrize("grid,state_dtype,lower_bound,H,K,W,launch", [
    ("prep", torch.float32, -5.0, 3, 24, 4, dict(prep_heads=2, norm_heads=2)),
    ("prep", torch.bfloat16, None, 2, 32, 3, dict(prep_heads=2, prep_warps=2, norm_heads=4, norm_warps=1)),
    ("tiles", torch.bfloat16, -5.0, 3, 24, 4, dict(prep_heads=2, norm_heads=4, BV=8)),
    ("tiles", torch.float32, None, 2, 32, 2, dict(prep_heads=2, norm_heads=2, BV=32)),
    ("stream", torch.float32, -5.0, 3, 32, 4, dict(prep_heads=2, norm_heads=4)),
])
def test_layer_decode_prep_heads(grid, state_dtype, lower_bound, H, K, W, launch):
    """The prep and norm launches with several heads per program: H=3 leaves heads of the last program
    outside the layer, K=V=24 masks part of each head's row, conv widths 2, 3 and 4."""
    launch = {"BV": 16, **launch}
    cases.layer_decode("cpu", B=3, H=H, K=K, state_dtype=state_dtype, lower_bound=lower_bound, W=W, grid=grid,
                       **launch)


@pytest.mark.parametrize("grid,state_dtype,launch", [
    ("prep", torch.float32, {}), ("tiles", torch.bfloat16, {}), ("block", torch.float32, {}),
    ("prep", torch.bfloat16, dict(prep_heads=1, norm_heads=2)),
])
def test_layer_decode_wide_conv(grid, state_dtype, launch):
    """A conv width of 5: the per-head prep kernel (without and with the v rows), which the several-heads kernel
    leaves to widths above 4, and the block layout's conv in its state kernel."""
    cases.layer_decode("cpu", B=3, H=2, K=24, state_dtype=state_dtype, W=5, grid=grid, BV=16, **launch)


@pytest.mark.parametrize("grid,state_dtype,B,micro_batches", [
    ("prep", torch.float32, 9, 2), ("tiles", torch.bfloat16, 13, 3), ("block", torch.bfloat16, 8, 2),
    ("stream", torch.float32, 5, 4),  # fewer rows than 4-row cuts for four ranges: two
])
def test_layer_decode_micro_batches(grid, state_dtype, B, micro_batches):
    """The batch cut into row ranges (here one after another: the two streams are CUDA's), each launched with
    the options resolved for the whole batch: every range's rows, slots and output rows, uneven ranges."""
    cases.layer_decode("cpu", B=B, H=2, K=24, state_dtype=state_dtype, grid=grid, BV=16, micro_batches=micro_batches)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3, 33])
def test_layer_decode_default_config(B, state_dtype):
    """The launcher's own choice (``decode_config``): B=1 the block layout with ``pdl`` (which only reaches the
    launcher here: the interpreter runs the launches in order; the GPU tests run the dependent launch); B=3 the
    prep layout with two-head prep launches (fp32 state) or the tiles layout (bf16), with four-head norm launches;
    B=33 the prep layout or the tiles layout, with one-head prep launches (its micro-batches are for CUDA graphs)."""
    cases.layer_decode("cpu", B=B, H=3, K=24, state_dtype=state_dtype)


def test_layer_decode_bad_layouts():
    a = cases.layer_decode_inputs("cpu", B=2, H=1, K=12, state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grid must be one of"):
        layer_decode.kda_layer_decode_launch(**a, grid="rows")
    with pytest.raises(ValueError, match="16-byte aligned state"):  # a 24-byte state row
        layer_decode.kda_layer_decode_launch(**a, grid="stream", BV=16)
    with pytest.raises(ValueError, match="launches must be"):
        layer_decode.kda_layer_decode_launch(**a, grid="prep", launches="prep+state")
    with pytest.raises(ValueError, match="prep_heads must be a power of two"):
        layer_decode.kda_layer_decode_launch(**a, grid="prep", prep_heads=3)
    with pytest.raises(ValueError, match="norm_heads > 1 needs a layout with a prep launch"):
        layer_decode.kda_layer_decode_launch(**a, grid="block", norm_heads=2)
    with pytest.raises(ValueError, match="pdl is an option of the block layout"):
        layer_decode.kda_layer_decode_launch(**a, grid="prep", pdl=True)
    with pytest.raises(ValueError, match="dot_sums is an option of the tiles layout"):
        layer_decode.kda_layer_decode_launch(**a, grid="stream", BV=16, dot_sums=True)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
        layer_decode.kda_layer_decode_launch(**a, grid="prep", micro_batches=0)
    with pytest.raises(ValueError, match="BV must be a power of two"):
        layer_decode.kda_layer_decode_launch(**a, grid="prep", BV=12)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        layer_decode.kda_layer_decode_launch(**a, grid="block", num_warps=3)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        layer_decode.kda_layer_decode_launch(**a, grid="prep", prep_warps=6)
    with pytest.raises(ValueError, match="maxnreg must be None or in"):
        layer_decode.kda_layer_decode_launch(**a, grid="tiles", maxnreg=300)


def test_decode_bad_options():
    """The bare recurrence's block options, refused before any launch; the state is left as it was."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 1, 16, generator=gen) for _ in range(3))
    g, beta = -torch.rand(2, 1, 16, generator=gen), torch.rand(2, 1, generator=gen)
    state = torch.randn(3, 1, 16, 16, generator=gen)
    before = state.clone()
    slots = torch.tensor([2, 0])
    for opts, msg in ((dict(BV=24), "BV must be a power of two"), (dict(num_warps=64), "num_warps must be at most 32"),
                      (dict(maxnreg=8), "maxnreg must be None or in")):
        with pytest.raises(ValueError, match=msg):
            kda_decode.kda_decode_launch(q, k, v, g, beta, state, slots, **opts)
    assert torch.equal(state, before)


def test_stream_programs_per_sm():
    """The persistent grid's size per SM from a compiled kernel's resources (sm_90: 64K registers, 228 KB of
    shared memory, 2048 threads): bound by shared memory, by registers, by threads, by the 32-program cap."""
    from flashinfra.kernels.kda.decode_stream import fit_per_sm

    assert fit_per_sm(126, 38092, 2) == 5  # 233472 // 39116
    assert fit_per_sm(178, 512, 2) == 5  # 23 units of 256 registers per warp: 65536 // 11776
    assert fit_per_sm(32, 0, 16) == 4 and fit_per_sm(16, 0, 1) == 32


@pytest.mark.parametrize("lens", [[1, 2, 40], [5], [3, 70]])
def test_conv_prefill(lens):
    cases.conv_prefill("cpu", lens, C=40, BT=16, BC=16)


def test_conv_decode():
    cases.conv_decode("cpu", B=4, C=70)


def test_dispatch_runs_triton_under_interpreter():
    """Under the interpreter the public ops take the Triton path: bad arguments raise the launchers'
    errors, which the references do not check."""
    q = torch.randn(3, 2, 16)
    state = torch.zeros(2, 2, 16, 16)
    with pytest.raises(ValueError, match="state slots must be distinct"):
        kda_prefill.kda_prefill(q, q, q, -torch.rand(3, 2, 16), torch.rand(3, 2), state, [0, 1, 3], [0, 0],
                                [False, False])
    with pytest.raises(ValueError, match="shapes disagree"):
        kda_decode.kda_decode(q, q, q, -torch.rand(3, 2, 8), torch.rand(3, 2), state, torch.tensor([0, 1, 0]))


def test_tiny_model_greedy_tokens_same_with_kernels_and_references(tmp_path, monkeypatch):
    cases.tiny_model_greedy_same(tmp_path, monkeypatch, "cpu")


@pytest.mark.parametrize("options", [dict(u_in_state=False), dict(u_in_state=True, w_in_state=False),
                                     dict(u_in_state=True)])
def test_prefill_v3_next_sequence_cannot_leak(options):
    """Non-finite values in one sequence's v leave the sequences before and after it bitwise unchanged: the rows past
    a sequence's end that a chunk's tiles cover are zeroed (kernel B), or bounded by the state pass's own descriptor
    of the sequence's rows (``u_in_state``, and ``w_in_state``, where the state pass's first product accumulates
    onto them), before any product, where 0 x inf would be NaN."""
    gen = torch.Generator().manual_seed(0)
    lens, H, K, V = [70, 30, 64], 2, 32, 16
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=gen).bfloat16() for D in (K, K, V))
    g = -0.3 * torch.sigmoid(torch.randn(T, H, K, generator=gen))
    beta = torch.rand(T, H, generator=gen)
    s0 = torch.randn(3, H, K, V, generator=gen)
    cu = [0, 70, 100, 164]
    got = []
    for bad in (False, True):
        vv = v.clone()
        if bad:
            vv[70:100] = float("inf")
        s = s0.clone()
        o = kda_prefill.kda_prefill_launch(q, k, vv, g, beta, s, cu, [0, 1, 2], [True] * 3, version="v3",
                                           **options)
        got.append((o, s))
    (o, s), (o_bad, s_bad) = got
    assert torch.equal(o[:70], o_bad[:70]) and torch.equal(o[100:], o_bad[100:])
    assert torch.equal(s[0], s_bad[0]) and torch.equal(s[2], s_bad[2])
    assert not torch.isfinite(s_bad[1]).all()  # the bad sequence's own state does take the values in