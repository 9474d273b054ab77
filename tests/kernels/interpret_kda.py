"""The KDA and conv Triton kernels run by Triton's CPU interpreter at small sizes. Collected only through
``test_interpret.py``, which runs this file in a subprocess with ``TRITON_INTERPRET=1`` (the variable
must be set before Triton compiles anything, and must not leak into the rest of the suite)."""

import pytest
import torch

from flashinfra.kernels.kda import prefill as kda_prefill
from flashinfra.kernels.kda import decode as layer_decode
from tests.kernels import kda_cases as cases
from tests.kernels import model_cases


@pytest.mark.parametrize("lens", [[63], [1, 17, 40, 2], [33, 16], [5, 0, 3]])
def test_prefill_float32_varlen(lens):
    cases.prefill_varlen("cpu", lens, H=2, K=16, V=32)


def test_prefill_float32_long_odd():
    """A long sequence: the state carried through eleven 16-token chunks, the last one partial."""
    cases.prefill_varlen("cpu", [173], H=1, K=16, V=16, seed=3)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_prefill_float32_gated(lower_bound):
    cases.prefill_varlen("cpu", [21, 50], H=2, K=32, V=16, gated=True, lower_bound=lower_bound, seed=1)


def test_prefill_float32_odd_head_size():
    """A head size the 64-token kernels do not tile (K=24) takes the 16-token ones, whatever the dtype."""
    cases.prefill_varlen("cpu", [70, 5], H=1, K=24, V=16, seed=2, dtype=torch.bfloat16)


# prefix checkpoints inside the step: at chunk boundaries, inside a chunk (the short tail pass; from a slot's
# initial state or a fresh one), two at one chunk boundary, at a sequence's end
FP32_CHECKPOINTS = ([40, 37], [(0, 16), (0, 21), (0, 32), (0, 40), (1, 5), (1, 30)])
CHUNK64_CHECKPOINTS = ([150, 70], [(0, 64), (0, 80), (0, 128), (0, 150), (1, 3), (1, 64), (1, 69)])


@pytest.mark.parametrize("gated", [False, True])
def test_prefill_float32_checkpoints(gated):
    cases.prefill_checkpoints("cpu", *FP32_CHECKPOINTS, gated=gated)


# bf16 activations: u and w formed in the state pass (no kernel for w); fp16: the tile w and u from their own kernel.
# The 64-token kernels' cost under the interpreter is their chunks times heads: one head where a case is not about
# heads, each case in the dtype whose kernels it is about, or in both where their kernels differ on it
BF16, FP16 = torch.bfloat16, torch.float16
HALF = [BF16, FP16]


@pytest.mark.parametrize("lens,dtype,H", [
    ([63], BF16, 2), ([63], FP16, 2),  # one partial chunk, two heads
    ([1, 17, 70, 2], BF16, 1),  # short sequences, one of two chunks
    ([5, 0, 129], FP16, 1),  # an empty sequence, a one-token chunk
])
def test_prefill_chunk64_varlen(lens, dtype, H):
    cases.prefill_varlen("cpu", lens, H=H, K=16, V=32, dtype=dtype)


# the state pass's checkpoint stores are one code for both dtypes: two heads in one of them
@pytest.mark.parametrize("dtype,gated,H", [(BF16, True, 1), (FP16, False, 2)])
def test_prefill_chunk64_checkpoints(dtype, gated, H):
    cases.prefill_checkpoints("cpu", *CHUNK64_CHECKPOINTS, H=H, dtype=dtype, gated=gated)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_prefill_bfloat16_state(dtype):
    """A bf16 state (--kda-state-dtype bfloat16) in either kernel family: read into float32, stored rounded (two
    heads, then one head gated)."""
    cases.prefill_varlen("cpu", [1, 70, 33], H=2, K=16, V=32, dtype=dtype, state_dtype=torch.bfloat16, seed=5)
    cases.prefill_varlen("cpu", [21, 130], H=1, K=32, V=16, dtype=dtype, gated=True, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype,gated,H", [(torch.float32, True, 2), (BF16, False, 1)])
def test_prefill_checkpoints_bfloat16_state(dtype, gated, H):
    points = FP32_CHECKPOINTS if dtype == torch.float32 else CHUNK64_CHECKPOINTS
    cases.prefill_checkpoints("cpu", *points, H=H, dtype=dtype, gated=gated, state_dtype=torch.bfloat16)


@pytest.mark.parametrize("lens,kw", [
    # slow decay: the far sub-blocks' products matter; a one-token sequence (two heads: one head's 16 bf16 outputs
    # are too few for the bound on the relative norm of the error)
    ([1, 100, 37], dict(dtype=BF16, H=2, decay=0.1)),
    ([63, 5, 0, 129], dict(dtype=FP16, decay=0.5)),  # an empty sequence, a one-token chunk
    # the gate with and without its lower bound (the gate pass's alone: test_gate_pass_scratch)
    ([21, 130], dict(dtype=BF16, gated=True, lower_bound=-0.3, decay=0.1)),
    ([77, 3], dict(dtype=FP16, gated=True, lower_bound=None, decay=0.2)),
    # an empty last sequence (its chunk offset is the end of the scratch), in either state pass
    ([37, 64, 0], dict(dtype=BF16, decay=0.1)),
    ([37, 64, 0], dict(dtype=FP16, decay=0.1)),
    ([1, 70, 33], dict(dtype=BF16, V=32, decay=0.3)),
    # value rows wider than key rows; q, k and v rows of two heads 8 elements longer (a 16-byte multiple: read in
    # place, by each dtype's own kernels) and 1 longer (copied first for the copy engine); rows past each
    # sequence's end
    ([1, 70, 0, 5], dict(dtype=BF16, H=2, K=32, V=64, decay=0.3, row_pad=8)),
    ([1, 70, 0, 5], dict(dtype=FP16, H=2, K=32, V=64, decay=0.3, row_pad=8)),
    ([1, 70, 0, 5], dict(dtype=FP16, K=32, V=64, decay=0.3, row_pad=1)),
])
def test_prefill_chunk64_cases(lens, kw):
    """The gate pass, the in-chunk kernels and the state pass together at odd sequence lengths and decays."""
    cases.prefill_varlen("cpu", lens, **{"H": 1, "K": 32, "V": 16, "seed": 4, **kw})


# two heads in the first case of each in-chunk kernel, one in the others
@pytest.mark.parametrize("lens,kw", [
    # slow decay; an empty sequence, one-token chunks; two K slices
    ([70, 1, 0, 65], dict(H=2, decay=0.1, KS=16)),
    ([70, 33], dict(gated=True, lower_bound=-5.0, decay=0.5)),
    ([70, 33], dict(decay=0.5, a_lo=False, num_warps=1)),  # Aqk's hi half alone
    # -kg and exp(gl) in the w/u kernel's place (bf16 v), with Aqk's hi half alone (as the launcher runs it),
    # one-token chunks, gated
    ([70, 1, 0, 65], dict(gated=True, lower_bound=-5.0, decay=0.5, a_lo=False, kg=True)),
    ([70, 33], dict(decay=0.1, KS=16, a_lo=False, kg=True)),
])
def test_prefill_chunk64_intra_diag(lens, kw):
    """The diagonal kernel alone against float64, reading the gate pass's scratch, its own poisoned: the diagonal blocks
    and Aqk's zeros above them (check_intra_cases.intra_diag)."""
    cases.intra_diag("cpu", lens, **{"H": 1, "K": 32, **kw})


@pytest.mark.parametrize("lens,kw", [
    ([70, 1, 0, 65], dict(H=2, decay=0.1)),  # slow decay; an empty sequence, one-token chunks; two K slices
    ([70, 33], dict(gated=True, lower_bound=-5.0, decay=0.5, num_warps=2)),
    ([70, 33], dict(gated=True, lower_bound=None, decay=0.3, KS=32)),  # one K slice
    ([70, 1, 0, 65], dict(gated=True, lower_bound=None, decay=0.3)),  # one-token chunks, gated
    ([70, 33], dict(decay=0.5, a_lo=False)),  # Aqk's hi half alone (the default launch's)
    ([70, 1, 0, 65], dict(decay=0.1, solve="bf16x3")),  # the merge in three bf16 products
    ([70, 33], dict(gated=True, lower_bound=-5.0, decay=5.0, solve="bf16x3")),
    ([70, 1, 0, 65], dict(decay=0.1, stages=1)),  # the slices unpipelined
])
def test_prefill_chunk64_intra_offdiag(lens, kw):
    """The off-diagonal kernel alone against float64, reading the gate pass's scratch, its own poisoned
    (check_intra_cases.intra_offdiag)."""
    cases.intra_offdiag("cpu", lens, **{"H": 1, "K": 32, **kw})


@pytest.mark.parametrize("lens,kw", [
    ([1, 100, 0, 37], dict(K=64, BK=32, num_warps=1)),  # two column blocks (beta from the first); an empty sequence
    ([1, 100, 0, 37], dict(K=64)),  # the launcher's shape: one block of 64 on two warps
    ([21, 130], dict(K=32, gated=True, lower_bound=-5.0, decay=0.5)),
    ([77, 3], dict(K=32, gated=True, lower_bound=None, decay=50.0, g_dtype=torch.bfloat16)),  # the -10 clamp
])
def test_gate_pass_scratch(lens, kw):
    """The gate pass alone against float64, scratch poisoned (check_intra_cases.gate_scratch)."""
    cases.gate_scratch("cpu", lens, H=2, **kw)


@pytest.mark.parametrize("dtype", HALF)
def test_prefill_chunk64_long_odd(dtype):
    cases.prefill_varlen("cpu", [333], H=1, K=16, V=16, seed=3, dtype=dtype)


# the layer decode's configurations (``decode_config``): B=1 the block layout (its norm launch's ``pdl`` only
# reaches the launcher here: the interpreter runs the launches in order; the GPU tests run the dependent launch);
# B=3 the prep layout with two-head prep launches; B=33 one-head prep launches; four-head norm launches
@pytest.mark.parametrize("B,state_dtype,lower_bound,H,K,W", [
    (1, torch.float32, -5.0, 2, 24, 4), (1, torch.bfloat16, None, 2, 32, 3),
    (3, torch.float32, -5.0, 3, 24, 4), (3, torch.bfloat16, None, 2, 32, 3),
    (3, torch.float32, None, 2, 32, 2), (33, torch.float32, -5.0, 2, 24, 4), (33, torch.bfloat16, None, 1, 16, 4),
])
def test_layer_decode(B, state_dtype, lower_bound, H, K, W):
    """Both state dtypes (a bf16 state rounded once per step), with and without the gate's lower bound; K=V=24
    masks part of a block and of each head's row; H=3 leaves heads of the last prep and norm program outside the
    layer; conv widths 2, 3 and 4."""
    cases.layer_decode("cpu", B=B, H=H, K=K, state_dtype=state_dtype, lower_bound=lower_bound, W=W)


@pytest.mark.parametrize("state_dtype,B", [(torch.float32, 9), (torch.bfloat16, 13)])
def test_layer_decode_micro_batches(state_dtype, B, monkeypatch):
    """The batch cut into the row ranges of a CUDA graph's micro-batches (here one after another: the two streams
    are CUDA's), each launched with the configuration of the whole batch: every range's rows, slots and output
    rows, uneven ranges."""
    monkeypatch.setattr(layer_decode, "in_graph_capture", lambda qkv: True)
    cases.layer_decode("cpu", B=B, H=2, K=24, state_dtype=state_dtype)


def test_layer_decode_bad_conv_width():
    a = cases.layer_decode_inputs("cpu", B=2, H=1, K=16, W=5)
    with pytest.raises(ValueError, match="conv_weight"):
        layer_decode.kda_layer_decode_launch(**a)


# rows=64: chunks of 4 tiles, so a sequence spans several chunks and a chunk ends inside one (170 = 2 x 64 + 42)
@pytest.mark.parametrize("lens,rows", [([1, 2, 40], 16), ([5], 16), ([3, 70], 16), ([170, 3, 64], 64)])
def test_conv_prefill(lens, rows):
    cases.conv_prefill("cpu", lens, C=40, BT=16, BC=16, rows=rows)


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
    a = cases.layer_decode_inputs("cpu", B=2, H=1, K=16)
    with pytest.raises(ValueError, match="bad shapes"):
        layer_decode.kda_layer_decode(**{**a, "gate": a["gate"][:, :8]})


def test_tiny_model_greedy_tokens_same_with_kernels_and_references(tmp_path, monkeypatch):
    """A prefill and three decode steps: a decode after the prefill and after a decode (each launch configuration of
    the decode: test_layer_decode)."""
    cases.tiny_model_greedy_same(tmp_path, monkeypatch, "cpu", steps=4)


def test_tiny_model_bfloat16_state_kernels_match_references(tmp_path, monkeypatch):
    """--kda-state-dtype bfloat16: the model's KDA prefill and decode kernels (and the conv's) against their
    references, both rounding the state to bf16 where they store it; every other op runs its reference in both runs
    (their kernels run in this model in interpret_hotpath.py), so only these are compared.
    The interpreter truncates to bf16 where torch rounds to nearest: a bias toward zero at every decode step's
    store, which compounds (about 0.5% of the logits' norm per step here; a layout or dtype slip would be of order
    1), hence two decode steps and 3e-2."""
    from flashinfra.feedback.registry import compare
    from flashinfra.kernels import dispatch
    from flashinfra.kernels.kda import conv
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.quant.cache import CacheSpec

    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=2, tokenizer=False), quantization="none",
                       cache_spec=CacheSpec.from_flags("auto", "bfloat16"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    mine = {"kda_prefill_gated_launch": kda_prefill, "kda_layer_decode_launch": layer_decode,
            "causal_conv1d_prefill_launch": conv}
    ran = set()
    for name, mod in mine.items():
        def counted(*args, _f=getattr(mod, name), _n=name, **kwargs):
            ran.add(_n)
            return _f(*args, **kwargs)

        monkeypatch.setattr(mod, name, counted)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    logits = []
    for kernels in (False, True):
        for mod in set(mine.values()):
            monkeypatch.setattr(mod, "use_triton", lambda *tensors, _k=kernels: _k)
        logits.append(model_cases.batched_greedy(model, prompts, 3)[1])
    assert ran == set(mine), f"launched: {ran}"
    cases.assert_passed([compare(f"bf16 KDA state, step {i}", a, b, atol=3e-2, rtol=3e-2)
                         for i, (a, b) in enumerate(zip(logits[1], logits[0]))])


@pytest.mark.parametrize("dtype", HALF)
def test_prefill_chunk64_next_sequence_cannot_leak(dtype):
    """Non-finite values in one sequence's v leave the sequences before and after it bitwise unchanged: the rows past
    a sequence's end that a chunk's tiles cover are zeroed (the w/u kernel, fp16), or bounded by the state pass's own
    descriptor of the sequence's rows (bf16, where the state pass's first product accumulates onto them), before any
    product, where 0 x inf would be NaN."""
    gen = torch.Generator().manual_seed(0)
    lens, H, K, V = [70, 30, 64], 1, 32, 16
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=gen).to(dtype) for D in (K, K, V))
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
        o = kda_prefill.kda_prefill_launch(q, k, vv, g, beta, s, cu, [0, 1, 2], [True] * 3)
        got.append((o, s))
    (o, s), (o_bad, s_bad) = got
    assert torch.equal(o[:70], o_bad[:70]) and torch.equal(o[100:], o_bad[100:])
    assert torch.equal(s[0], s_bad[0]) and torch.equal(s[2], s_bad[2])
