"""The transition-map kernel run by Triton's CPU interpreter at small sizes, outputs NaN-poisoned, against the
float64 product of the token factors. Collected only through ``test_kda_chain.py``, which sets
``TRITON_INTERPRET=1`` in a subprocess."""

import pytest
import torch

from flashinfra.kernels.kda.chain import kda_transition_launch
from tests.kernels import kda_chain_cases as cases


@pytest.mark.parametrize("decay", ["slow", "bound"])
@pytest.mark.parametrize("K,lens", [(16, [63, 0, 17, 100]), (24, [33, 5])])
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
