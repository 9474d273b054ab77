"""ReplaySSM: verify reads the checkpoint only; fold = sequential decode, bit for bit, and the float64 state."""

from __future__ import annotations

import torch

from flashinfra.kernels.kda.decode import kda_layer_decode_ref
from flashinfra.model.replay import (ReplayRing, copy_bytes_per_slot, kda_fold, kda_layer_verify,
                                     replay_bytes_per_slot)

H, K, V, W, R = 3, 8, 5, 4, 6
C = H * (2 * K + V)


def _params(g, dtype=torch.float32):
    return dict(conv_weight=torch.randn(C, W, generator=g).to(dtype) / 2,
                A_log=torch.rand(H, generator=g).to(dtype) + 0.5,
                dt_bias=0.1 * torch.randn(H * K, generator=g).to(dtype), lower_bound=-5.0,
                norm_weight=1 + 0.1 * torch.randn(V, generator=g).to(dtype), eps=1e-5)


def _tokens(g, T, dtype=torch.float32):
    return (torch.randn(T, C, generator=g).to(dtype), torch.randn(T, H * K, generator=g).to(dtype),
            torch.randn(T, H, generator=g).to(dtype), torch.randn(T, H * V, generator=g).to(dtype))


def _decode(p, toks, conv, state, slot):
    """Sequential decode of tokens ``toks`` of one sequence into ``conv``/``state`` slot ``slot``."""
    qkv, g_raw, b, gate = toks
    out = []
    for t in range(qkv.shape[0]):
        out.append(kda_layer_decode_ref(qkv[t : t + 1], p["conv_weight"], conv, g_raw[t : t + 1], b[t : t + 1],
                                        gate[t : t + 1], p["A_log"], p["dt_bias"], p["lower_bound"], p["norm_weight"],
                                        p["eps"], state, torch.tensor([slot])))
    return torch.cat(out)


def _verify(p, toks, conv, state, ring, slots, cu):
    qkv, g_raw, b, gate = toks
    return kda_layer_verify(qkv, p["conv_weight"], conv, g_raw, b, gate, p["A_log"], p["dt_bias"], p["lower_bound"],
                            p["norm_weight"], p["eps"], state, ring, slots, cu)


def test_verify_reads_only_and_fold_is_decode_bitwise():
    g = torch.Generator().manual_seed(0)
    p = _params(g)
    slots, lens, acc = [2, 0, 3], [4, 1, 6], [2, 1, 6]
    conv = torch.randn(4, C, W - 1, generator=g)
    state = torch.randn(4, H, K, V, generator=g)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    toks = _tokens(g, cu[-1])
    ring = ReplayRing.allocate(4, R, H, K, V, torch.float32, "cpu")
    conv0, state0 = conv.clone(), state.clone()
    out = _verify(p, toks, conv, state, ring, slots, cu)
    assert torch.equal(conv, conv0) and torch.equal(state, state0)
    kda_fold(ring, conv, state, slots, acc)
    for b, slot in enumerate(slots):
        c_ref, s_ref = conv0.clone(), state0.clone()
        seq = tuple(x[cu[b] : cu[b + 1]] for x in toks)
        o_ref = _decode(p, seq, c_ref, s_ref, slot)
        assert torch.equal(out[cu[b] : cu[b + 1]], o_ref)
        c_acc, s_acc = conv0.clone(), state0.clone()
        _decode(p, tuple(x[: acc[b]] for x in seq), c_acc, s_acc, slot)
        assert torch.equal(state[slot], s_acc[slot]) and torch.equal(conv[slot], c_acc[slot])
    assert torch.equal(state[1], state0[1])  # a slot not in the batch is untouched


def test_rounds_of_verify_and_fold_track_the_float64_sequential_state():
    g = torch.Generator().manual_seed(1)
    p = _params(g)
    p64 = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    conv, state = torch.zeros(1, C, W - 1), torch.zeros(1, H, K, V)
    conv64, state64 = conv.double(), state.double()
    ring = ReplayRing.allocate(1, R, H, K, V, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(2)
    for _ in range(40):  # 40 rounds, ~100 accepted tokens
        n = int(torch.randint(1, R + 1, (1,), generator=gen))
        a = int(torch.randint(1, n + 1, (1,), generator=gen))
        toks = _tokens(g, n)
        _verify(p, toks, conv, state, ring, [0], [0, n])
        kda_fold(ring, conv, state, [0], [a])
        _decode(p64, tuple(x[:a].double() for x in toks), conv64, state64, 0)
    torch.testing.assert_close(state.double(), state64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv.double(), conv64, rtol=0, atol=0)


def test_replay_memory_below_copies():
    Hr, Kr = 64, 128
    for r in (2, 4, 6, 8):
        assert (replay_bytes_per_slot(Hr, Kr, Kr, 4, r, torch.bfloat16)
                < copy_bytes_per_slot(Hr, Kr, Kr, 4, r, torch.bfloat16) / 2)
