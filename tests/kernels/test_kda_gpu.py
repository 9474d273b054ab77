"""KDA and conv kernels on a CUDA device at real sizes (H=64, K=V=128), against float64 references, and the
precision of the state chain: a plain bf16 (64-token chunks) or tf32 (float32 activations) product there is
measurably worse than bf16x3 or tf32x3."""

import itertools

import pytest
import torch

from flashinfra.kernels.kda import decode as layer, prefill as kda_prefill, prefill_fp32
from flashinfra.kernels.kda import ref as kda_ref
from flashinfra.kernels.microbatch import micro_ranges, on_two_streams
from tests.kernels import kda_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_prefill_float32_varlen_real_size():
    cases.prefill_varlen("cuda", [1000, 63, 1, 300], H=8, K=128, V=128, dtype=torch.float32)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_prefill_float32_gated_real_size(lower_bound):
    cases.prefill_varlen("cuda", [777, 64], H=4, K=128, V=128, dtype=torch.float32, gated=True,
                         lower_bound=lower_bound)


@pytest.mark.parametrize("dtype,decay", [(torch.bfloat16, 0.1), (torch.bfloat16, 5.0), (torch.float16, 0.1),
                                         (torch.float16, 5.0)])
def test_prefill_chunk64_real_size(dtype, decay):
    """The 64-token-chunk kernels (bf16: u and w formed in the state pass; fp16: their own kernel); slow decay makes
    the products between a chunk's far sub-blocks matter."""
    cases.prefill_varlen("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, V=128, dtype=dtype, decay=decay)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lower_bound,decay", [(-5.0, 5.0), (-0.3, 0.1), (None, 5.0), (None, 0.2)])
def test_prefill_chunk64_gated_real_size(lower_bound, decay, dtype):
    cases.prefill_varlen("cuda", [777, 64, 1], H=8, K=128, V=128, dtype=dtype, gated=True,
                         lower_bound=lower_bound, decay=decay)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_chunk64_padded_rows(dtype):
    """q, k and v rows one element longer (copied first for the copy engine) and 8 longer (read in place)."""
    for pad in (1, 8):
        cases.prefill_varlen("cuda", [517, 20], H=2, K=128, V=128, dtype=dtype, decay=0.3, row_pad=pad)


# prefix checkpoints inside the step (checkpoints.py): every 1024 tokens, the last block boundary (inside a chunk:
# the tail pass), the sequence's end, and inside the first chunk of a sequence that continues its slot
CHECKPOINT_LENS = [3000, 200]
CHECKPOINTS = [(0, 1024), (0, 2048), (0, 2992), (0, 3000), (1, 16), (1, 128), (1, 130)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_bfloat16_state_real_size(dtype):
    """--kda-state-dtype bfloat16: both kernel families read the bf16 slots into float32 and store rounded."""
    cases.prefill_varlen("cuda", [1000, 63, 1, 300], H=8, K=128, V=128, dtype=dtype, gated=True,
                         state_dtype=torch.bfloat16)
    cases.prefill_checkpoints("cuda", CHECKPOINT_LENS, CHECKPOINTS, H=4, K=128, V=128, dtype=dtype,
                              state_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype,gated", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True),
                                         (torch.float32, True)])
def test_prefill_checkpoints_real_size(dtype, gated):
    cases.prefill_checkpoints("cuda", CHECKPOINT_LENS, CHECKPOINTS, H=4, K=128, V=128, dtype=dtype, gated=gated)


def test_conv_windows_at_checkpoints_real_size():
    cases.conv_checkpoints("cuda", CHECKPOINT_LENS, CHECKPOINTS, C=3 * 64 * 128)


@pytest.mark.parametrize("gated,lower_bound,decay,a_lo,kg", [
    (False, -5.0, 0.1, True, False), (True, -5.0, 0.5, True, False), (False, -5.0, 5.0, False, False),
    (True, -5.0, 5.0, False, False), (False, -5.0, 0.1, False, True), (True, -5.0, 5.0, False, True)])
def test_intra_d_real_size(gated, lower_bound, decay, a_lo, kg):
    """The diagonal kernel alone against float64 with its scratch poisoned (check_intra_cases.intra_diag): the diagonal
    blocks of Aqk and Ai, Aqk's zeros above them and the state pass's qg and kd (with ``kg``, -kg and exp(gl) too),
    at the launcher's two warps, K slices of 32 and tf32 products."""
    cases.intra_diag("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, dtype=torch.bfloat16, gated=gated,
                        lower_bound=lower_bound, decay=decay, KS=32, num_warps=2, precision="tf32", a_lo=a_lo, kg=kg)


@pytest.mark.parametrize("gated,lower_bound,decay,precision,solve", [
    (False, -5.0, 0.1, "tf32", None), (False, -5.0, 5.0, "ieee", None), (True, -5.0, 0.5, "tf32", None),
    (True, None, 0.2, "tf32", None), (False, -5.0, 5.0, "ieee", "bf16x3"), (True, -5.0, 0.1, "ieee", "bf16x3")])
def test_intra_a_real_size(gated, lower_bound, decay, precision, solve):
    """The off-diagonal kernel alone against float64 with its scratch poisoned (check_intra_cases.intra_offdiag),
    reading the gate pass's scratch: the off-diagonal blocks of Aqk and L and the merged inverse, at the launcher's
    one warp and K slices of 16."""
    cases.intra_offdiag("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, dtype=torch.bfloat16, gated=gated,
                  lower_bound=lower_bound, decay=decay, KS=16, num_warps=1, precision=precision, solve=solve)


@pytest.mark.parametrize("gated,lower_bound,decay,g_dtype", [(False, -5.0, 5.0, torch.float32),
                                                             (True, -5.0, 5.0, torch.bfloat16),
                                                             (True, None, 50.0, torch.bfloat16)])
def test_gate_pass_scratch_real_size(gated, lower_bound, decay, g_dtype):
    """The gate pass alone against float64, scratch poisoned (check_intra_cases.gate_scratch); the last case at the
    -10 clamp."""
    cases.gate_scratch("cuda", [1000, 63, 1, 300, 64, 129], H=8, K=128, gated=gated, lower_bound=lower_bound,
                       decay=decay, g_dtype=g_dtype)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 2, 9, 33, 67])
def test_layer_decode_real_size(B, state_dtype):
    """Each configuration ``decode_config`` picks: the block layout (B=1), the prep layout with two-head (B=2, 9)
    and one-head (B=33, 67) prep launches."""
    cases.layer_decode("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16)


@pytest.mark.parametrize("B,state_dtype", [(1, torch.float32), (67, torch.float32), (67, torch.bfloat16)])
def test_layer_decode_graph_steps(B, state_dtype, monkeypatch):
    """Three decode steps replayed from one CUDA graph: each step's launches must see the previous step's state
    and conv slot (after B=1's dependent norm launch has ended; after both streams of the micro-batches have
    joined); each step's output is checked. The row ranges launched are recorded: the configuration's
    micro-batches only inside the capture."""
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
                                  out=out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.kda_layer_decode_launch(**a, out=out)
    captured = layer.decode_config(B)["micro_batches"]
    assert ranges == ([micro_ranges(B, captured)] if captured > 1 else []), "the row ranges of the two calls"
    rel, atol, rtol = cases.tolerances(torch.bfloat16, "cuda")
    for _ in range(steps):
        out.fill_(float("nan"))
        graph.replay()
        ref = kda_ref.kda_layer_decode_ref(**r)
        torch.cuda.synchronize()
        cases.assert_close("o", out, ref, rel, atol, rtol)
    cases.assert_close("state", a["state"], r["state"], 4e-3, 1e-2, 1e-2)
    assert torch.equal(a["conv_state"].double(), r["conv_state"]), "conv state differs from the reference shift"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [67, 64, 9])
def test_layer_decode_micro_batches_match(B, state_dtype, monkeypatch):
    """Micro-batches on two streams (as inside a CUDA graph, here eager) give the single launch's output and states
    bit for bit (the same kernels on disjoint rows and slots)."""
    a = cases.layer_decode_inputs("cuda", B=B, H=64, K=128, state_dtype=state_dtype, dtype=torch.bfloat16)
    results = []
    for micro in (False, True):
        monkeypatch.setattr(layer, "in_graph_capture", lambda qkv: micro)
        x = {**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()}
        out = torch.full((B, 64, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer.kda_layer_decode_launch(**x, out=out)
        results.append((out, x["conv_state"], x["state"]))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("B", [1, 5])
def test_layer_decode_fp32_activations(B):
    cases.layer_decode("cuda", B=B, H=64, K=128, dtype=torch.float32)


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
    a = cases.layer_decode_inputs("cuda", B=2, H=1, K=16)
    with pytest.raises(ValueError, match="bad shapes"):
        layer.kda_layer_decode(**{**a, "gate": a["gate"][:, :8]})


def test_float32_plain_tf32_state_chain_is_worse_than_tf32x3(monkeypatch):
    """Slow decay (long memory), T=16384, in-chunk products in tf32x3 so that only the state chain differs:
    the final state's error against float64 with the chain in plain tf32 is many times that with tf32x3
    (which stays near fp32 rounding). The chain's precision is the float32 path's module constant."""
    T, H, K = 16384, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen) for _ in range(3))
    g = -0.02 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    s64 = torch.zeros(1, H, K, K, dtype=torch.float64, device="cuda")
    ref = kda_ref.kda_prefill_ref(q.double(), k.double(), v.double(), g.double(), beta.double(), s64, [0, T],
                                      [0], [False])
    monkeypatch.setattr(prefill_fp32, "LOCAL_PRECISION", "tf32x3")
    errs = {}
    for prec in ("tf32", "tf32x3"):
        monkeypatch.setattr(prefill_fp32, "CHAIN_PRECISION", prec)
        s = torch.full((1, H, K, K), float("nan"), device="cuda")
        o = kda_prefill.kda_prefill_launch(q, k, v, g, beta, s, [0, T], [0], [False])
        errs[prec] = (float((s.double() - s64).norm() / s64.norm()), float((o.double() - ref).norm() / ref.norm()))
    assert errs["tf32x3"][0] < 1e-4, errs
    assert errs["tf32"][0] > 5 * errs["tf32x3"][0], errs


def _final_state_f64(q, k, v, g, beta):
    """The final state of one sequence from zero, computed in float64 throughout (``kda_prefill_ref`` casts
    its inputs to float32, which at these lengths is no longer far below the errors compared here)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    s0 = torch.zeros(H, K, V, dtype=torch.float64, device=q.device)
    _, s = kda_ref.kda_chunk_one_ref(kda_ref.l2norm_ref(q), kda_ref.l2norm_ref(k), v, g, beta, s0)
    return s[None]


def test_chunk64_state_chain_precisions(monkeypatch):
    """The 64-token kernels' state chains at T=16384 with slow decay (log-decay -0.02 sigmoid(x)), in-chunk
    products in tf32x3 so that only the chain differs, final state against float64 (on the bf16 inputs). bf16x3
    (every chain operand a bf16 hi + lo pair) stays near fp32 rounding; bf16x2 (w and kd one bf16 each) sits at
    one bf16 rounding of kd (and w), which enters every chunk's update of S but does not compound (the state keeps
    16 bits), so it is bounded below plain bf16, and it is not close to bf16x3. The chain is the module constant
    ``prefill.CHAIN``."""
    T, H, K = 16384, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = -0.02 * torch.sigmoid(torch.randn(T, H, K, device="cuda", generator=gen))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    s64 = _final_state_f64(q, k, v, g, beta)
    monkeypatch.setattr(kda_prefill, "LOCAL_PRECISION", "tf32x3")
    errs = {}
    for prec in ("bf16", "bf16x2", "bf16x3"):
        monkeypatch.setattr(kda_prefill, "CHAIN", prec)
        s = torch.full((1, H, K, K), float("nan"), device="cuda")
        kda_prefill.kda_prefill_launch(q, k, v, g, beta, s, [0, T], [0], [False])
        errs[prec] = float((s.double() - s64).norm() / s64.norm())
    print("final-state relative error against float64:", errs)
    assert errs["bf16x3"] < 1e-4, errs
    assert errs["bf16"] > 5 * errs["bf16x3"], errs
    assert 9e-4 < errs["bf16x2"] < 4e-3 and errs["bf16x2"] < errs["bf16"], errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk64_state_l2_prefetch_changes_nothing(dtype, monkeypatch):
    """The state pass's L2 prefetch (``STATE_L2_AHEAD``: one, two or no steps ahead) moves nothing into the
    program: outputs and final states bitwise those without it, in a packed batch with empty and one-token
    sequences."""
    lens, H = [1000, 0, 1, 300, 64, 129], 4
    T = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(T, H, 128, device="cuda", generator=gen).to(dtype) for _ in range(3))
    g = -5 * torch.sigmoid(torch.randn(T, H, 128, device="cuda", generator=gen))
    beta = torch.rand(T, H, device="cuda", generator=gen)
    s0 = torch.randn(len(lens), H, 128, 128, device="cuda", generator=gen)
    cu = [0] + list(itertools.accumulate(lens))
    got = []
    for ahead in (0, 1, 2):
        monkeypatch.setattr(kda_prefill, "STATE_L2_AHEAD", ahead)
        s = s0.clone()
        o = kda_prefill.kda_prefill_launch(q, k, v, g, beta, s, cu, list(range(len(lens))), [True] * len(lens))
        got.append((o, s))
    for o, s in got[1:]:
        assert torch.equal(o, got[0][0]) and torch.equal(s, got[0][1])


def test_tiny_model_greedy_tokens_same_with_kernels_and_references(tmp_path, monkeypatch):
    cases.tiny_model_greedy_same(tmp_path, monkeypatch, "cuda")
