"""The KDA transition map on the CPU: its float64 reference is the product of the token factors; the float32
chain (maps and final states of the segments, folded) against the float64 truth, for slow decay and at the -5
gate bound; the Triton kernels run under the CPU interpreter in ``interpret_kda_chain.py`` (``test_interpret.py``): the
map against float64, and the chained segments on the kernel path against one pass."""


import pytest
import torch

from flashinfra.kernels.kda.ref import (kda_chunk_one_ref, kda_prefill_ref, kda_summary_ref, kda_transition_ref,
                                       l2norm_ref)
from flashinfra.parallel.context import fold
from tests.kernels import kda_chain_cases as cases



@pytest.fixture(autouse=True)
def one_thread():
    """Small ops on a shared host: threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("decay", ["slow", "bound"])
def test_transition_reference_is_the_token_product(decay):
    lens = [63, 1, 40]
    k, _, g, beta, _ = cases.inputs(sum(lens), 2, 8, 8, decay)
    cu = [0, 63, 64, 104]
    m = kda_transition_ref(k.double(), g.double(), beta.double(), cu, segment=20)  # segments cross chunks
    for b, (bos, eos) in enumerate(zip(cu, cu[1:])):
        want = cases.token_product(k[bos:eos], g[bos:eos], beta[bos:eos])
        assert cases.rel_error(m[b], want) < 1e-12, (decay, b)


def test_summary_reference_is_the_map_and_the_state_from_zero():
    """``kda_summary_ref``'s M is the transition map and its H the chunked final state from zero, per sequence."""
    lens = [63, 1, 140]
    T, H, K, V = sum(lens), 2, 8, 16
    k, v, g, beta, _ = cases.inputs(T, H, K, V, "slow", seed=3)
    cu = [0, 63, 64, 204]
    m, h = kda_summary_ref(k.double(), v.double(), g.double(), beta.double(), cu, segment=128)
    assert cases.rel_error(m, kda_transition_ref(k.double(), g.double(), beta.double(), cu)) < 1e-12
    for b, (bos, eos) in enumerate(zip(cu, cu[1:])):
        kn = l2norm_ref(k[bos:eos].double())
        _, want = kda_chunk_one_ref(kn, kn, v[bos:eos].double(), g[bos:eos].double(), beta[bos:eos].double(),
                                    torch.zeros(H, K, V, dtype=torch.float64))
        assert cases.rel_error(h[b], want) < 1e-12, b


@pytest.mark.parametrize("decay", ["slow", "bound"])
def test_chain_fold_matches_float64(decay):
    """Five segments' float32 maps and zero-start states, folded, give the final state of the whole sequence
    from a nonzero initial state, within float32 rounding of the float64 truth."""
    T, H, K, V = 333, 2, 16, 8
    k, v, g, beta, _ = cases.inputs(T, H, K, V, decay, seed=1)
    s0 = torch.randn(H, K, V, generator=torch.Generator().manual_seed(2))
    cu = [0, 70, 131, 200, 264, 333]
    n = len(cu) - 1
    maps = kda_transition_ref(k, g, beta, cu)
    offsets = torch.full((n, H, K, V), float("nan"))
    kda_prefill_ref(k, k, v, g, beta, offsets, cu, list(range(n)), [False] * n)
    got = fold(list(maps), list(offsets), s0)[-1]
    kn = l2norm_ref(k.double())
    _, want = kda_chunk_one_ref(kn, kn, v.double(), g.double(), beta.double(), s0.double())
    assert cases.rel_error(got, want) < 1e-6, decay  # one float32 pass: 1.4e-7 (slow), 2e-6 (bound)
