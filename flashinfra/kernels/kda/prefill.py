"""KDA chunked prefill over packed variable-length sequences, with state slots.

Kimi Delta Attention per head, with a per-channel decay ``g`` (log space) and a scalar ``beta``:
``S_t = diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (q_t / sqrt(K))``
with ``q`` and ``k`` L2-normalised. States are ``[K, V]`` float32 per head.

The reference is the chunked (WY) form: within a chunk of ``BT`` tokens the delta rule is solved as a
triangular system, and the state is carried from chunk to chunk. It reads each sequence's initial state
from its slot (or zeros for a sequence that starts here) and writes the final state back to the slot.

Triton path (``version="v3"``, the default for bf16 and fp16 inputs; kda_prefill_v3.py): 64-token chunks.
The in-chunk work runs for all chunks in parallel, in kernels of short dependent chains (the in-chunk
matrices: the diagonal 16-token blocks and their inverses with the per-chunk tiles, kda_prefill_intra64_split.py,
the off-diagonal blocks per 16-row block and the WY merge, kda_prefill_intra64_rows.py; for float32 v or output
also the tile w, kda_prefill_intra64_b.py),
then one sequential pass per (value block, sequence, head) carries the state in float32 registers through warpgroup
products per chunk. Those of ``w S`` (by default ``Aib (kg S)``, below) and ``kd^T v'`` carry it from chunk to
chunk, so rounding there compounds over the whole sequence: by default (``V3_CHAIN = "bf16x3"``) every operand of
them enters as a bf16 hi + lo pair (three bf16 products, about 16 bits of each operand, as precise as tf32x3 here),
never as a single bf16 or tf32 operand, whose rounding each step shows up in the state (see
tests/kernels/test_kda_gpu.py). By default (bf16 v and output) the state pass also forms u from v and ``Ai
diag(beta)`` as a bf16 pair, so u's own rounding stays out of the state, and applies that pair to ``-k exp(gc) S``
itself in w's place. Against a float64 recurrence at T=65536 and 131072 the default's final-state error is 6.7e-6
to 1.6e-4, 1/24 to 1/325 of flash-linear-attention's, its output's 2.5e-3, 0.53-0.67x flash-linear-attention's
(bench/results/kda_precision_w_in_state.json). ``chain_precision="bf16x2"`` rounds the per-chunk factors w (or kg)
and kd to one bf16 each: the call 10% faster on an H200, its state error 1.5-1.8e-3 (still below
flash-linear-attention's 2.2-3.9e-3, but that of a single-bf16 operand in the chain; bench/notes/kda_precision.md).

``version="v2"`` (kda_prefill_split.py) is the earlier 16-token-chunk form: one launch for the in-chunk work
(the WY inverse as the product ``(I + A)(I + A^2)(I + A^4)...``, A nilpotent), a second for the state with
its products in ``chain_precision`` "tf32x3" (or "ieee", which the benchmarks use as the high-precision
reference on the GPU; "tf32" shows the plain product's error in a test). On an H200 v3 is 1.9-2.1x faster
(bench/notes/kda_prefill.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from flashinfra.kernels.dispatch import use_triton
from flashinfra.kernels.kda.gate import kda_gate_ref, l2norm_ref
from flashinfra.kernels.kda.prefill_fp32 import kda_prefill_split
from flashinfra.kernels.kda.prefill_launch import kda_prefill_v3
from flashinfra.kernels.varlen import cached_int_lists


def float32_path(dtype: torch.dtype, K: int, V: int) -> bool:
    """Whether the 16-token-chunk kernels run: for float32 activations (their tf32x3 chain keeps the state at
    float32 accuracy, the 64-token kernels' bf16 pairs about 16 bits: far below a 16-bit model's rounding, not
    below a float32 one's) and for head sizes the 64-token kernels do not tile (powers of two, at least 16)."""
    return dtype == torch.float32 or min(K, V) < 16 or bool(K & (K - 1)) or bool(V & (V - 1))


def kda_chunk_one_ref(
    q: torch.Tensor,  # [L, H, K] float32, L2-normalised
    k: torch.Tensor,  # [L, H, K] float32, L2-normalised
    v: torch.Tensor,  # [L, H, V] float32
    g: torch.Tensor,  # [L, H, K] float32 log-decay
    beta: torch.Tensor,  # [L, H] float32
    state: torch.Tensor,  # [H, K, V] float32 initial state
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [L, H, V], final state [H, K, V]
    L, H, K = k.shape
    BT = chunk_size
    pad = (BT - L % BT) % BT
    # [H, N, BT, *]
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(H, -1, BT, x.shape[-1]) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).transpose(0, 1).reshape(H, -1, BT)
    q = q * K**-0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g = g.cumsum(-2)
    strict_upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=1)
    upper = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=0)
    # decay[i, j] = exp(g_i - g_j) for j <= i, per channel
    decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(strict_upper[..., None], float("-inf")).exp()
    A = -(k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(upper, 0)
    for i in range(1, BT):  # forward substitution: (I - A)^-1, row by row
        A[..., i, :i] = A[..., i, :i].clone() + (A[..., i, :i, None].clone() * A[..., :i, :i].clone()).sum(-2)
    A = A + torch.eye(BT, dtype=A.dtype, device=A.device)
    u = A @ v_beta  # [H, N, BT, V]
    w = A @ (k_beta * g.exp())  # [H, N, BT, K]
    o = torch.empty_like(u)
    S = state.clone()
    for n in range(u.shape[1]):
        q_n, k_n, g_n = q[:, n], k[:, n], g[:, n]
        qk = (q_n[..., :, None, :] * k_n[..., None, :, :] * decay[:, n]).sum(-1).masked_fill(strict_upper, 0)
        v_new = u[:, n] - w[:, n] @ S
        o[:, n] = (q_n * g_n.exp()) @ S + qk @ v_new
        S = S * g_n[:, -1, :, None].exp() + (k_n * (g_n[:, -1:] - g_n).exp()).transpose(-1, -2) @ v_new
    o = o.reshape(H, -1, o.shape[-1])[:, :L].transpose(0, 1)
    return o, S


def kda_prefill_ref(
    q: torch.Tensor,  # [T, H, K] any float dtype, not yet normalised
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, H, V]
    g: torch.Tensor,  # [T, H, K] float32 log-decay (see kda_gate)
    beta: torch.Tensor,  # [T, H] float32 in (0, 1)
    state: torch.Tensor,  # [num_slots, H, K, V] float32, final states written in place
    cu_seqlens: list[int],  # B + 1
    state_slots: list[int],  # [B]
    has_initial_state: list[bool],  # [B]
) -> torch.Tensor:  # [T, H, V] in q's dtype
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for b, slot in enumerate(state_slots):
        bos, eos = cu_seqlens[b], cu_seqlens[b + 1]
        s0 = state[slot].float() if has_initial_state[b] else state.new_zeros(state.shape[1:], dtype=torch.float32)
        o, s1 = kda_chunk_one_ref(
            l2norm_ref(q[bos:eos].float()),
            l2norm_ref(k[bos:eos].float()),
            v[bos:eos].float(),
            g[bos:eos].float(),
            beta[bos:eos].float(),
            s0,
        )
        out[bos:eos] = o.to(q.dtype)
        state[slot] = s1.to(state.dtype)
    return out


def kda_prefill_gated_ref(
    q, k, v,
    g_raw: torch.Tensor,  # [T, H, K] f_b(f_a(x)) before the bias
    beta_logits: torch.Tensor,  # [T, H] b_proj(x)
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H * K]
    lower_bound: float | None,
    state, cu_seqlens, state_slots, has_initial_state,
) -> torch.Tensor:
    """``kda_prefill`` with the gate and beta computed from their raw projections."""
    g = kda_gate_ref(g_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_logits.float())
    return kda_prefill_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state)


def _output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.shape != shape or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(f"kda_prefill: out must be contiguous {list(shape)} {like.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    return out


def _seq_args(cu_seqlens, state_slots, has_initial_state, T: int, num_slots: int, device):
    """Validate the per-sequence arguments (lists or tensors) and move them to the device as int32 (varlen.py)."""
    def as_list(x):
        return [int(i) for i in (x.tolist() if isinstance(x, torch.Tensor) else x)]

    cu, slots, init = as_list(cu_seqlens), as_list(state_slots), as_list(has_initial_state)
    B = len(cu) - 1
    if B < 0 or cu[0] != 0 or cu[-1] != T or any(b > e for b, e in zip(cu, cu[1:])):
        raise ValueError(f"kda_prefill: cu_seqlens must rise from 0 to {T}, got {cu}")
    if len(slots) != B or len(init) != B:
        raise ValueError(f"kda_prefill: {B} sequences need {B} state slots and has_initial_state flags")
    if any(not 0 <= s < num_slots for s in slots) or len(set(slots)) != B:
        raise ValueError(f"kda_prefill: state slots must be distinct and in [0, {num_slots}), got {slots}")
    return cu, *cached_int_lists((cu, slots, init), device)  # no stream sync; the batch's layers share them


def _launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, gate, out):
    T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (T, H, K) or v.shape[:2] != (T, H) or g.shape != (T, H, K) or beta.shape != (T, H):
        raise ValueError(
            f"kda_prefill: shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
            f"g {tuple(g.shape)} beta {tuple(beta.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"kda_prefill: q, k and v must have one dtype, got {q.dtype} {k.dtype} {v.dtype}")
    if state.dim() != 4 or state.shape[1:] != (H, K, V) or not state.is_contiguous():
        raise ValueError(f"kda_prefill: state must be contiguous [slots, {H}, {K}, {V}], got {tuple(state.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"kda_prefill: {name} must have contiguous heads ([T, H, D] rows, any row stride)")
    if beta.stride(1) != 1:
        raise ValueError("kda_prefill: beta must have contiguous heads")
    cu, cu_t, slots_t, init_t = _seq_args(cu_seqlens, state_slots, has_initial_state, T, state.shape[0], q.device)
    B = len(cu) - 1
    o = _output(out, (T, H, V), q)
    if B == 0 or T == 0:
        return o
    if float32_path(q.dtype, K, V):
        return kda_prefill_split(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate)
    return kda_prefill_v3(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate)


def kda_prefill_launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state,
                       out: torch.Tensor | None = None):
    """Triton ``kda_prefill``: 64-token chunks for 16-bit activations, 16-token chunks for float32 ones
    (``float32_path``)."""
    return _launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, None, out)


def kda_prefill_gated_launch(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, cu_seqlens,
                             state_slots, has_initial_state, out: torch.Tensor | None = None):
    H, K = q.shape[1], q.shape[2]
    if A_log.shape != (H,) or dt_bias.shape != (H * K,):
        raise ValueError(f"kda_prefill_gated: A_log must be [{H}] and dt_bias [{H * K}]")
    return _launch(q, k, v, g_raw, beta_logits, state, cu_seqlens, state_slots, has_initial_state,
                   (A_log.contiguous(), dt_bias.contiguous(), lower_bound), out)


def kda_prefill(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state):
    if use_triton(q, k, v, g, beta, state):
        return kda_prefill_launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state)
    return kda_prefill_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state)


def kda_prefill_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, cu_seqlens, state_slots,
                      has_initial_state):
    """``kda_prefill`` with the gate (lower bound included) and ``beta = sigmoid(beta_logits)`` fused in."""
    if use_triton(q, k, v, g_raw, beta_logits, state):
        return kda_prefill_gated_launch(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state,
                                        cu_seqlens, state_slots, has_initial_state)
    return kda_prefill_gated_ref(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, cu_seqlens,
                                 state_slots, has_initial_state)
