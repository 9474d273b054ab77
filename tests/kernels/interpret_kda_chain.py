"""The transition-map kernel run by Triton's CPU interpreter at small sizes, outputs NaN-poisoned, against the
float64 product of the token factors. Collected only through ``test_kda_chain.py``, which sets
``TRITON_INTERPRET=1`` in a subprocess."""

import pytest
import torch

from flashinfra.kernels.kda.chain import kda_transition_launch
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
    got, final = kda_context_prefill(Comm(1), split_prompt(T, 1, zigzag=True), 0, q, k, v, g_raw, beta_logits, A_log,
                                     dt_bias, lower_bound, s0)
    assert cases.rel_error(got, want) < 1e-5
    assert cases.rel_error(final, state[0]) < 1e-5
