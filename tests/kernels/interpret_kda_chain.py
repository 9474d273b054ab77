"""The transition-map kernel run by Triton's CPU interpreter at small sizes, outputs NaN-poisoned, against the
float64 product of the token factors. Collected only through ``test_kda_chain.py``, which sets
``TRITON_INTERPRET=1`` in a subprocess."""

import pytest
import torch

from flashinfra.kernels.kda.chain import kda_summary_launch, kda_transition_launch
from flashinfra.kernels.kda.ref import kda_chunk_one_ref, l2norm_ref
from tests.kernels import kda_chain_cases as cases


@pytest.mark.parametrize("decay,K,lens", [("slow", 16, [63, 0, 17, 100]), ("bound", 24, [33, 5]),
                                          ("long", 16, [200])])
def test_chain_kernel_against_float64(decay, K, lens):
    H = 2
    k, _, g, beta, gate = cases.inputs(sum(lens), H, K, 8, decay, seed=K)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = torch.full((len(lens), H, K, K), float("nan"))
    if gate is None:
        kda_transition_launch(k, g, beta, cu, out=out)
    else:
        g_raw, beta_logits, A_log, dt_bias, lower_bound = gate
        kda_transition_launch(k, g_raw, beta_logits, cu, (A_log, dt_bias, lower_bound), out=out)
    for b, (bos, eos) in enumerate(zip(cu, cu[1:])):
        want = cases.token_product(k[bos:eos], g[bos:eos], beta[bos:eos])
        assert cases.rel_error(out[b], want) < 2e-5, (decay, K, lens, b)


@pytest.mark.parametrize("decay,K,V,lens", [("slow", 16, 8, [63, 0, 17]), ("bound", 16, 32, [40, 5])])
def test_summary_kernel_against_float64(decay, K, V, lens):
    """M and H in one walk (H's columns after M's, V other than K): each against the float64 truth, H the final
    state of the chunked reference from zero."""
    H = 2
    k, v, g, beta, gate = cases.inputs(sum(lens), H, K, V, decay, seed=K + V)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out = torch.full((len(lens), H, K, K), float("nan"))
    out_h = torch.full((len(lens), H, K, V), float("nan"))
    if gate is None:
        kda_summary_launch(k, v, g, beta, cu, out=out, out_h=out_h)
    else:
        g_raw, beta_logits, A_log, dt_bias, lower_bound = gate
        kda_summary_launch(k, v, g_raw, beta_logits, cu, (A_log, dt_bias, lower_bound), out=out, out_h=out_h)
    for b, (bos, eos) in enumerate(zip(cu, cu[1:])):
        assert cases.rel_error(out[b], cases.token_product(k[bos:eos], g[bos:eos], beta[bos:eos])) < 2e-5
        kn = l2norm_ref(k[bos:eos].double())
        _, want = kda_chunk_one_ref(kn, kn, v[bos:eos].double(), g[bos:eos].double(), beta[bos:eos].double(),
                                    torch.zeros(H, K, V, dtype=torch.float64))
        if eos > bos:
            assert cases.rel_error(out_h[b], want) < 2e-5, (decay, b)
        else:
            assert not out_h[b].any()


def test_segments_chained_equal_one_pass():
    """The context-parallel KDA op on its kernel path (prefill kernels and the chain), one rank playing a whole
    zig-zag split (two segments, chained by the fold), against one pass from the same initial state."""
    from flashinfra.kernels.kda import kda_prefill_gated
    from flashinfra.parallel.collectives import Comm
    from flashinfra.parallel.context import kda_context_prefill, split_prompt

    T, H, K = 150, 2, 16
    k, v, _, _, gate = cases.inputs(T, H, K, K, "bound", seed=5)
    g_raw, beta_logits, A_log, dt_bias, lower_bound = gate
    q = torch.randn(T, H, K, generator=torch.Generator().manual_seed(6))
    s0 = torch.randn(H, K, K, generator=torch.Generator().manual_seed(7))
    state = s0[None].clone()
    want = kda_prefill_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, [0, T], [0], [True])
    got, final, _ = kda_context_prefill(Comm(1), split_prompt(T, 1, zigzag=True), 0, q, k, v, g_raw, beta_logits, A_log,
                                     dt_bias, lower_bound, s0)
    assert cases.rel_error(got, want) < 1e-5
    assert cases.rel_error(final, state[0]) < 1e-5
