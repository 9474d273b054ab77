"""The transition map, and the summary (M and H in one walk), on a CUDA device at the real head size (K=128)
against float64, the chain's precision
(plain tf32 measurably worse than tf32x3 over a 64k-token part), and a KDA prefill split into segments and
chained equal to one pass."""

import pytest
import torch

from flashinfra.kernels.kda import kda_prefill_gated
from flashinfra.kernels.kda.chain import kda_summary_launch, kda_transition_launch
from flashinfra.kernels.kda.ref import kda_summary_ref, kda_transition_ref
from flashinfra.parallel.collectives import Comm
from flashinfra.parallel.context import kda_context_prefill, split_prompt
from tests.kernels import kda_chain_cases as cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# M's error is measured against at least float32's smallest normal: at the gate's bound a long sequence's map
# (1e-196 after 1000 tokens) lies below what a float32 map can hold, and the kernel's 0 is right there
F32_TINY = torch.finfo(torch.float32).tiny


def _launch(k, g, beta, gate, cu, precision):
    if gate is None:
        return kda_transition_launch(k, g, beta, cu, precision=precision)
    g_raw, beta_logits, A_log, dt_bias, lower_bound = gate
    return kda_transition_launch(k, g_raw, beta_logits, cu, (A_log, dt_bias, lower_bound), precision=precision)


@pytest.mark.parametrize("decay", ["slow", "bound", "long"])
def test_chain_kernel_real_size(decay):
    lens = [1000, 63, 1, 4097]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    k, _, g, beta, gate = cases.inputs(cu[-1], 4, 128, 128, decay, device="cuda")
    want = kda_transition_ref(k.double(), g.double(), beta.double(), cu, segment=512)
    got = _launch(k, g, beta, gate, cu, "tf32x3")
    for b in range(len(lens)):
        err = cases.rel_error(got[b], want[b], F32_TINY)
        assert err < 1e-5, (decay, lens[b], err)


@pytest.mark.parametrize("decay", ["slow", "bound"])
def test_summary_kernel_real_size(decay):
    """bf16 k and v as the model feeds them: M and H against the float64 chunked reference of the same inputs."""
    lens = [1000, 63, 4097]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    k, v, g, beta, gate = cases.inputs(cu[-1], 4, 128, 128, decay, device="cuda")
    k, v = k.bfloat16(), v.bfloat16()
    want_m, want_h = kda_summary_ref(k.double(), v.double(), g.double(), beta.double(), cu, segment=512)
    if gate is None:
        got_m, got_h = kda_summary_launch(k, v, g, beta, cu)
    else:
        g_raw, beta_logits, A_log, dt_bias, lower_bound = gate
        got_m, got_h = kda_summary_launch(k, v, g_raw, beta_logits, cu, (A_log, dt_bias, lower_bound))
    for b in range(len(lens)):
        assert cases.rel_error(got_m[b], want_m[b], F32_TINY) < 1e-5, (decay, lens[b], "M")
        assert cases.rel_error(got_h[b], want_h[b]) < 1e-5, (decay, lens[b], "H")


def test_tf32x3_chain_closer_than_tf32():
    """Over one 64k-token part that the state remembers (4096 16-token chunk factors), plain tf32 products
    leave an error that tf32x3 does not."""
    T = 65536
    k, _, g, beta, gate = cases.inputs(T, 2, 128, 128, "long", device="cuda")
    want = kda_transition_ref(k.double(), g.double(), beta.double(), [0, T], segment=512)[0]
    err = {p: cases.rel_error(_launch(k, g, beta, gate, [0, T], p)[0], want) for p in ("tf32", "tf32x3")}
    print(f"chain over {T} tokens, error / max|M|: tf32 {err['tf32']:.3g}, tf32x3 {err['tf32x3']:.3g}")
    assert err["tf32x3"] < 1e-4
    assert err["tf32"] > 10 * err["tf32x3"], err


@pytest.mark.parametrize("zigzag", [False, True])
def test_segments_chained_equal_one_pass(zigzag):
    """One rank playing a whole split (world 1: zig-zag gives it two segments, chained in the fold)."""
    T, H, K = 5000, 4, 128
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(T, H, K, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    g_raw = torch.randn(T, H, K, generator=gen).cuda()
    beta_logits = torch.randn(T, H, generator=gen).cuda()
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log().cuda()
    dt_bias = 0.5 * torch.randn(H * K, generator=gen).cuda()
    s0 = torch.randn(H, K, K, generator=gen).cuda()
    state = s0[None].clone()
    want = kda_prefill_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, -5.0, state, [0, T], [0], [True])
    split = split_prompt(T, 1, zigzag)
    got, final, _ = kda_context_prefill(Comm(1), split, 0, q, k, v, g_raw, beta_logits, A_log, dt_bias, -5.0, s0)
    assert cases.rel_error(got.float(), want.float()) < 2e-2
    assert cases.rel_error(final, state[0]) < 1e-3
