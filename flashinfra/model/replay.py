"""ReplaySSM for KDA layers: verify draft tokens without writing the recurrent state, then fold the
accepted prefix into it by replaying the exact decode recurrence.

Per request and KDA layer the cache keeps one **committed checkpoint** (the layer's ordinary state slot:
recurrent state ``[H, K, V]`` and conv window of the last ``W - 1`` committed inputs) plus a **ring** of the
per-token inputs seen since then: the raw q|k|v before the conv (for the conv window) and the recurrence's
inputs ``k, v, g, beta`` after the conv and gate. ``kda_layer_verify`` runs up to ``R`` tokens per sequence
from the checkpoint (reading it only) and writes their ring entries; a rejected draft needs nothing (the
ring is overwritten by the next verify: a cursor move); ``kda_fold`` replays the accepted entries onto the
checkpoint with the same step as decode (``kda_decode_ref``), so the state after the fold is bit for bit
the state sequential decode would hold (a chunked reconstruction would drift), and shifts the conv window
by the accepted count. Together the committed conv window and the ring's raw inputs are the window of
``W - 1 + R`` inputs.

Memory per request and layer: one state plus ``R`` ring entries, against ``1 + R`` state copies for the
copy-per-draft baseline (``replay_bytes_per_slot`` / ``copy_bytes_per_slot``).

The verify and the fold run fused Triton kernels where the dispatch allows it (``flashinfra.kernels.kda.verify``:
the decode update looped over a sequence's tokens with the state in registers, never stored;
``flashinfra.kernels.kda.fold``: the same update over the accepted ring entries, written back in place), else the
PyTorch references here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.kda.conv import causal_conv1d_decode_ref
from flashinfra.kernels.kda.ref import kda_decode_ref, kda_gate_ref
from flashinfra.kernels.kda.fold import kda_fold_launch
from flashinfra.kernels.kda.verify import kda_layer_verify_launch
from flashinfra.kernels.norms import gated_rms_norm_ref


@dataclass
class ReplayRing:
    """Ring entries of one KDA layer for every state slot; entry ``i`` of a slot is the ``i``-th token since
    its checkpoint."""

    x: torch.Tensor  # [num_slots, R, C] q|k|v before the conv (activation dtype)
    k: torch.Tensor  # [num_slots, R, H, K] after the conv, before the L2 norm
    v: torch.Tensor  # [num_slots, R, H, V]
    g: torch.Tensor  # [num_slots, R, H, K] float32 log-decay
    beta: torch.Tensor  # [num_slots, R, H] float32

    @staticmethod
    def allocate(num_slots: int, R: int, H: int, K: int, V: int, dtype: torch.dtype,
                 device: torch.device | str) -> "ReplayRing":
        def z(*shape, dt=dtype):
            return torch.zeros(num_slots, R, *shape, dtype=dt, device=device)

        return ReplayRing(x=z(H * (2 * K + V)), k=z(H, K), v=z(H, V), g=z(H, K, dt=torch.float32),
                          beta=z(H, dt=torch.float32))

    @property
    def capacity(self) -> int:
        return self.x.shape[1]


def replay_bytes_per_slot(H: int, K: int, V: int, W: int, R: int, dtype: torch.dtype,
                          state_dtype: torch.dtype = torch.float32) -> int:
    """State bytes per request and KDA layer under ReplaySSM: checkpoint + conv window + ring of R."""
    a, s, f = (torch.empty((), dtype=d).element_size() for d in (dtype, state_dtype, torch.float32))
    C = H * (2 * K + V)
    return H * K * V * s + C * (W - 1) * a + R * (C * a + H * (K + V) * a + H * K * f + H * f)


def copy_bytes_per_slot(H: int, K: int, V: int, W: int, R: int, dtype: torch.dtype,
                        state_dtype: torch.dtype = torch.float32) -> int:
    """The copy-per-draft baseline: a state and conv window for the checkpoint and for each of R tokens."""
    a, s = (torch.empty((), dtype=d).element_size() for d in (dtype, state_dtype))
    return (1 + R) * (H * K * V * s + H * (2 * K + V) * (W - 1) * a)


def kda_layer_verify(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                     norm_weight, eps, state, ring: ReplayRing, state_slots: list[int], cu_seqlens: list[int],
                     device_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Every token's output as decode run token by token from the checkpoint would give it, with the ring
    entries written and the checkpoint (state and conv window) only read (``kda_layer_verify_ref``).
    ``device_rows``: ``state_slots`` and ``cu_seqlens`` already on the device, which the kernel then reads (nothing
    copied from the host: a CUDA graph captures this)."""
    longest = max((b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])), default=0)
    if longest > ring.capacity:
        raise ValueError(f"kda_layer_verify: {longest} tokens exceed the ring's {ring.capacity} entries")
    if use_triton(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, state):
        if device_rows is not None:
            slots, cu = device_rows
        else:
            slots = torch.tensor(state_slots, dtype=torch.int32, device=qkv.device)
            cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=qkv.device)
        return kda_layer_verify_launch(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias,
                                       lower_bound, norm_weight, eps, state, ring, slots, cu)
    return kda_layer_verify_ref(qkv, conv_weight, conv_state, g_raw, beta_logits, gate, A_log, dt_bias, lower_bound,
                                norm_weight, eps, state, ring, state_slots, cu_seqlens)


def kda_layer_verify_ref(
    qkv: torch.Tensor,  # [T, C] q|k|v before the conv, packed sequences
    conv_weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [num_slots, C, W - 1] committed windows, read only
    g_raw: torch.Tensor,  # [T, H*K]
    beta_logits: torch.Tensor,  # [T, H]
    gate: torch.Tensor,  # [T, H*V]
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,  # [num_slots, H, K, V] committed checkpoints, read only
    ring: ReplayRing,  # entries 0..n-1 of each sequence's slot written
    state_slots: list[int],
    cu_seqlens: list[int],
) -> torch.Tensor:  # [T, H, V]
    """The reference: each sequence steps a working copy of its checkpoint with ``kda_layer_decode_ref``'s ops
    (freed on return)."""
    T = qkv.shape[0]
    H, K, V = state.shape[1:]
    out = torch.empty(T, H, V, dtype=qkv.dtype, device=qkv.device)
    zero = torch.zeros(1, dtype=torch.long, device=qkv.device)
    for b, slot in enumerate(state_slots):
        bos, eos = cu_seqlens[b], cu_seqlens[b + 1]
        conv = conv_state[slot : slot + 1].clone()
        S = state[slot : slot + 1].clone()
        for i, t in enumerate(range(bos, eos)):
            x = qkv[t : t + 1]
            y = causal_conv1d_decode_ref(x, conv_weight, conv, zero)
            q, k, v = (y[:, : H * K].view(1, H, K), y[:, H * K : 2 * H * K].view(1, H, K),
                       y[:, 2 * H * K :].view(1, H, V))
            g = kda_gate_ref(g_raw[t : t + 1].view(1, H, K), A_log, dt_bias, lower_bound)
            beta = torch.sigmoid(beta_logits[t : t + 1].float())
            o = kda_decode_ref(q, k, v, g, beta, S, zero)
            out[t] = gated_rms_norm_ref(o, gate[t : t + 1].view(1, H, V), norm_weight, eps)[0]
            ring.x[slot, i], ring.k[slot, i], ring.v[slot, i] = x[0], k[0], v[0]
            ring.g[slot, i], ring.beta[slot, i] = g[0], beta[0]
    return out


def kda_fold(ring: ReplayRing, conv_state: torch.Tensor, state: torch.Tensor, state_slots: list[int],
             num_accepted: list[int], on_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Fold each slot's first ``num_accepted`` ring entries into its checkpoint: the decode step replayed
    (bit for bit what decode would have written), and the conv window shifted by the accepted count.
    ``on_device``: the two lists already on the state's device as int32 (one copy shared by every layer)."""
    if max(num_accepted, default=0) > ring.capacity:
        raise ValueError(f"kda_fold: {max(num_accepted)} accepted tokens exceed the ring's {ring.capacity} entries")
    if use_triton(state, conv_state, ring.k):
        dev = state.device
        slots_d, ns_d = on_device or (torch.tensor(state_slots, dtype=torch.int32, device=dev),
                                      torch.tensor(num_accepted, dtype=torch.int32, device=dev))
        kda_fold_launch(ring, conv_state, state, slots_d, ns_d)
        return
    kda_fold_ref(ring, conv_state, state, state_slots, num_accepted)


def kda_fold_ref(ring: ReplayRing, conv_state: torch.Tensor, state: torch.Tensor, state_slots: list[int],
                 num_accepted: list[int]) -> None:
    """The reference fold: ``kda_decode_ref``'s step per accepted entry, the window shifted by concatenation."""
    Wm1 = conv_state.shape[-1]
    zero = torch.zeros(1, dtype=torch.long, device=state.device)
    for slot, n in zip(state_slots, num_accepted):
        if n == 0:
            continue
        S = state[slot : slot + 1]
        for i in range(n):
            k = ring.k[slot, i : i + 1]
            # the state update does not read q; the output it returns is discarded
            kda_decode_ref(k, k, ring.v[slot, i : i + 1], ring.g[slot, i : i + 1], ring.beta[slot, i : i + 1], S, zero)
        window = torch.cat([conv_state[slot], ring.x[slot, :n].T.to(conv_state.dtype)], dim=-1)
        conv_state[slot] = window[:, window.shape[-1] - Wm1 :]
