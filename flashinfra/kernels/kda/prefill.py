"""KDA chunked prefill over packed variable-length sequences, with state slots: the public ops, their argument
checks, the choice of kernels and the launch sequence of the 64-token chunks (references in ref.py).

16-bit activations take 64-token chunks: a gate pass (prefill_gate.py: the log-decay's chunk-relative cumulative
sum and beta, once per chunk and head), the in-chunk matrices for all chunks in parallel (prefill_intra_diag.py:
the diagonal 16-token blocks, their inverses and the state pass's per-chunk tiles; prefill_intra_offdiag.py: the
off-diagonal blocks and the merge into the WY inverse; for fp16, prefill_intra_wu.py: the tiles w and u), then
one sequential pass per (value block, sequence, head) that carries the state in float32 registers
(prefill_state.py). The products that carry the state from chunk to chunk compound their rounding over the whole
sequence, so every operand of them enters as a bf16 hi + lo pair (three bf16 products, about 16 bits of each
operand, as precise as tf32x3 here), never as a single bf16 or tf32 operand, whose rounding each step shows up in
the state (tests/kernels/test_kda_gpu.py). For bf16 v the state pass also forms u from v and ``Aib = Ai
diag(beta)`` (a bf16 pair) and applies Aib to ``-k exp(gc) S`` in w's place, so u's own rounding stays out of the
state.

Float32 activations take 16-token chunks (prefill_fp32.py), whose tf32x3 chain keeps the state at float32
accuracy; the 64-token kernels' bf16 pairs keep about 16 bits, far below a 16-bit model's rounding but not below
a float32 one's.

Prefix checkpoints (checkpoints.py): the state pass of either family also stores the state after chosen chunks
into spare slots, and a checkpoint inside a chunk takes one more short launch over the tokens after that chunk's
start, for the whole batch at once.

The state slots are float32 or bf16 (``--kda-state-dtype``): either family reads a slot into float32 and rounds
to the slot's dtype where it stores (the final state and each checkpoint), so a bf16 state rounds once per
prefill step, as the decode kernels round it once per token.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from flashinfra import env
from flashinfra.kernels.dispatch import register_cap, use_triton
from flashinfra.kernels.kda.checkpoints import check_checkpoints, plan_checkpoints
from flashinfra.kernels.kda.prefill_fp32 import BT as FP32_CHUNK, kda_prefill_fp32
from flashinfra.kernels.kda.prefill_gate import kda_gate_pass_kernel
from flashinfra.kernels.kda.prefill_intra_diag import kda_intra_diag_kernel
from flashinfra.kernels.kda.prefill_intra_offdiag import kda_intra_offdiag_kernel
from flashinfra.kernels.kda.prefill_intra_wu import kda_intra_wu_kernel
from flashinfra.kernels.kda.prefill_state import kda_state_pass_kernel
from flashinfra.kernels.kda.ref import kda_prefill_gated_ref, kda_prefill_ref
from flashinfra.kernels.launch import cdiv, device_descriptors, fast
from flashinfra.kernels.varlen import cached_int_lists, chunk_tables

# The state chain's products: every operand a bf16 hi + lo pair (bf16x3: three bf16 products, about 16 bits of each
# operand, as precise as tf32x3 here), so that no single-bf16 rounding compounds in the state from chunk to chunk.
# bf16x2 (w and kd one bf16 each) and bf16 are kept for the test that shows them worse.
CHAIN_PRODUCTS = {"bf16x3": 3, "bf16x2": 2, "bf16": 1}
CHAIN = "bf16x3"
# the in-chunk products (Triton's tf32), and the merge into the inverse in three bf16 products
LOCAL_PRECISION, SOLVE_PRECISION = "tf32", "bf16x3"
# the state pass: [K, 64] value blocks on 4 warps, its tiles two steps deep (the bf16x3 chain's tile slots fill the
# shared memory at two), each step asking the L2 for the next step's tiles
STATE_BV, STATE_WARPS, STATE_STAGES, STATE_L2_AHEAD = 64, 4, 2, 1
# a step that saves prefix checkpoints converts Z's [BV, K] float32 tile through shared memory for the pointer store
# (32 KB), which with two stages of bf16x3 tiles passes sm_90's 227 KB: one stage there
STATE_SAVE_STAGES = 1
# the diagonal blocks: K slices of 32 on 2 warps, at most 128 registers (eight programs per SM)
DIAG_KS, DIAG_WARPS, DIAG_MAXNREG = 32, 2, 128
# the off-diagonal blocks: K slices of 32 by the copy engine, two deep
OFFDIAG_KS, OFFDIAG_STAGES = 32, 2
# w and u (fp16): key blocks of 32, value blocks of 64, three deep, on 4 warps capped at 168 registers
WU_BLOCK, WU_VALUE_BLOCK, WU_WARPS, WU_MAXNREG, WU_STAGES = 32, 64, 4, 168, 3
# the gate pass: 64 key columns per program on 2 warps
GATE_BLOCK, GATE_WARPS = 64, 2


def float32_path(dtype: torch.dtype, K: int, V: int) -> bool:
    """Whether the 16-token-chunk kernels run: for float32 activations (their tf32x3 chain keeps the state at
    float32 accuracy, the 64-token kernels' bf16 pairs about 16 bits: far below a 16-bit model's rounding, not
    below a float32 one's) and for head sizes the 64-token kernels do not tile (powers of two, at least 16)."""
    return dtype == torch.float32 or min(K, V) < 16 or bool(K & (K - 1)) or bool(V & (V - 1))


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


def _launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, gate, out, checkpoints=()):
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
    fp32 = float32_path(q.dtype, K, V)
    plan = saves_t = None
    if checkpoints:
        slots = [int(s) for s in (state_slots.tolist() if isinstance(state_slots, torch.Tensor) else state_slots)]
        init = [bool(i) for i in (has_initial_state.tolist() if isinstance(has_initial_state, torch.Tensor)
                                  else has_initial_state)]
        ckpts = check_checkpoints(checkpoints, cu, slots, state.shape[0])
        plan = plan_checkpoints(cu, slots, init, ckpts, FP32_CHUNK if fp32 else 64)
        copy_states(state, plan.before)
        if plan.saves:
            saves_t = cached_int_lists((plan.chunk_saves,), q.device)[0]
    if fp32:
        kda_prefill_fp32(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate, saves_t)
    else:
        kda_prefill_chunk64(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate, saves_t)
    if plan is not None:
        copy_states(state, plan.after)
        if plan.tail_rows:
            _tail_pass(q, k, v, g, beta, state, gate, plan)
    return o


def copy_states(state: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """``state[dst] = state[src]`` for each (src, dst)."""
    for src, dst in pairs:
        state[dst].copy_(state[src])


def _tail_pass(q, k, v, g, beta, state, gate, plan) -> None:
    """Carry each checkpoint inside a chunk from the state at the chunk's start (already in its slot) to its
    position: one launch over the short tails of the whole batch, their outputs dropped."""
    rows = cached_int_lists(([r for start, n in plan.tail_rows for r in range(start, start + n)],), q.device)[0]
    cu = [0]
    for _, n in plan.tail_rows:
        cu.append(cu[-1] + n)
    q_t, k_t, v_t, g_t, b_t = (x.index_select(0, rows) for x in (q, k, v, g, beta))
    _launch(q_t, k_t, v_t, g_t, b_t, state, cu, plan.tail_slots, plan.tail_init, gate, None)


def kda_prefill_launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state,
                       out: torch.Tensor | None = None, checkpoints=()):
    """Triton ``kda_prefill``: 64-token chunks for 16-bit activations, 16-token chunks for float32 ones
    (``float32_path``); the states at ``checkpoints`` (checkpoints.py) written into their slots."""
    return _launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, None, out, checkpoints)


def kda_prefill_gated_launch(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, cu_seqlens,
                             state_slots, has_initial_state, out: torch.Tensor | None = None, checkpoints=()):
    H, K = q.shape[1], q.shape[2]
    if A_log.shape != (H,) or dt_bias.shape != (H * K,):
        raise ValueError(f"kda_prefill_gated: A_log must be [{H}] and dt_bias [{H * K}]")
    return _launch(q, k, v, g_raw, beta_logits, state, cu_seqlens, state_slots, has_initial_state,
                   (A_log.contiguous(), dt_bias.contiguous(), lower_bound), out, checkpoints)


def kda_prefill(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, checkpoints=()):
    """Chunked prefill; each ``(seq, p, slot)`` of ``checkpoints`` also receives the state after ``p`` of that
    sequence's tokens (checkpoints.py)."""
    if use_triton(q, k, v, g, beta, state):
        return kda_prefill_launch(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state,
                                  checkpoints=checkpoints)
    return kda_prefill_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, has_initial_state, checkpoints)


def kda_prefill_gated(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, cu_seqlens, state_slots,
                      has_initial_state, checkpoints=()):
    """``kda_prefill`` with the gate (lower bound included) and ``beta = sigmoid(beta_logits)`` fused in."""
    if use_triton(q, k, v, g_raw, beta_logits, state):
        return kda_prefill_gated_launch(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state,
                                        cu_seqlens, state_slots, has_initial_state, checkpoints=checkpoints)
    return kda_prefill_gated_ref(q, k, v, g_raw, beta_logits, A_log, dt_bias, lower_bound, state, cu_seqlens,
                                 state_slots, has_initial_state, checkpoints)


def copy_engine_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] (heads contiguous, any row stride) itself where its base and row stride are 16-byte
    aligned, as the copy engine needs, else a contiguous copy."""
    if x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    return x


def rows_descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A descriptor over ``x`` [T, H, D] (``copy_engine_rows``) as [T, H * D] rows in ``block`` tiles."""
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], block)


def chunk64_launches(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate, saves_t=None):
    """The launches as closures over freshly allocated scratch, yielded in order, each as soon as its scratch
    exists, so that a caller launching them as they come has the GPU running the first while the host prepares
    the next. Each goes through ``launch.fast`` (the compiled kernel kept per configuration)."""
    T, H, K = q.shape
    V = v.shape[-1]
    if K & (K - 1) or V & (V - 1) or min(K, V) < 16:
        raise ValueError(f"kda_prefill: K and V must be powers of two >= 16, got K={K} V={V}")
    BV = min(STATE_BV, V)
    # bf16 v: u and w's product formed in the state pass from v, Aib and -kg (v exact in bf16 there, u's own
    # rounding out of the chain), no launch for w; fp16 v is not exact in bf16: w and u from their own launch
    aib_in_state = v.dtype == torch.bfloat16
    dev = q.device
    idx, offsets_t, nch = chunk_tables(cu, 64, dev)  # cached per batch, no stream sync (varlen.py)
    if not nch:
        return
    # w, qg, kd and Aqk in bf16, w and kd each followed by its lo half where the chain reads it
    chain = CHAIN_PRODUCTS[CHAIN]
    lo = {"W_LO": int(chain == 3), "KD_LO": int(chain == 3)}
    slots = dict(NS=3 + sum(lo.values()), SQ=1 + lo["W_LO"], SKD=2 + lo["W_LO"])
    A_log, dt_bias, lower_bound = gate if gate is not None else (g, g, 0.0)
    gate_args = dict(GATE_IN_KERNEL=gate is not None, HAS_LOWER_BOUND=gate is not None and lower_bound is not None,
                     BETA_LOGITS=gate is not None)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    interpret = env.triton_interpret()
    gc = torch.empty(nch, H, 64, K, dtype=torch.float32, device=dev)
    bc = torch.empty(nch, H, 64, dtype=torch.float32, device=dev)
    GBK = min(GATE_BLOCK, K)

    def gate_pass():
        fast(kda_gate_pass_kernel)[(nch * (K // GBK), H)](
            g, beta, A_log, dt_bias, lb, cu_t, idx, gc, bc, g.stride(0), beta.stride(0),
            H=H, K=K, BK=GBK, num_warps=GATE_WARPS, **gate_args,
        )

    yield "gate", gate_pass
    # Aqk's lo half for the bf16x3 chain's precision; with Aib in the state pass its ring has no room for it
    # (231,552 of the 232,448 bytes of shared memory without it, 247,952 with it, compiled for sm_90)
    a_lo = int(chain == 3 and not aib_in_state)
    aqk = torch.empty(nch, H, 1 + a_lo, 64, 64, dtype=torch.bfloat16, device=dev)
    ai = torch.empty(nch, H, 64, 64, dtype=torch.float32, device=dev)
    rn = torch.empty(nch, H, 2, 64, dtype=torch.float32, device=dev)  # the rows' norm factors
    # Aib = Ai diag(beta) as bf16 hi + lo pairs, for the state pass
    aib = torch.empty(nch, H, 2, 64, 64, dtype=torch.bfloat16, device=dev) if aib_in_state else ai
    # the in-chunk kernels read the gate pass's scratch: one compiled reader for the plain and the gated op
    in_args = (q, k, gc, bc, cu_t, idx, aqk, ai, rn, q.stride(0), k.stride(0))
    # the state pass's tiles: qg and kd (and -kg in w's place) from the diagonal kernel, else w from its own
    wqk = torch.empty(nch, H, slots["NS"], 64, K, dtype=torch.bfloat16, device=dev)
    egl = torch.empty(nch, H, K, dtype=torch.float32, device=dev)  # exp(gl)

    def intra_diag():
        fast(kda_intra_diag_kernel)[(nch * 4, H)](
            *in_args, K**-0.5, wqk, egl, H=H, K=K, KS=min(DIAG_KS, K), LOCAL_PRECISION=LOCAL_PRECISION, A_LO=a_lo,
            FAST_EXP=not interpret, **slots, KD_LO=lo["KD_LO"], KG=aib_in_state, W_LO=lo["W_LO"],
            num_warps=DIAG_WARPS, num_stages=1, **register_cap(DIAG_MAXNREG),
        )

    yield "intra_diag", intra_diag

    AKS = min(OFFDIAG_KS, K)
    tq, tk, tv = (copy_engine_rows(x) for x in (q, k, v))  # tiles by the copy engine
    a_d = [rows_descriptor(tq, [16, AKS]), rows_descriptor(tk, [16, AKS]),
           TensorDescriptor.from_tensor(gc.view(-1, K), [16, AKS])]

    def intra_offdiag():
        # each [16, 16] product on mma.sync runs in every warp of the program: one warp executes the fewest
        # instructions
        fast(kda_intra_offdiag_kernel)[(nch, H)](
            bc, cu_t, idx, aqk, ai, rn, *a_d, aib, H=H, K=K, KS=AKS, LOCAL_PRECISION=LOCAL_PRECISION,
            SOLVE_PRECISION=SOLVE_PRECISION, FAST_EXP=not interpret, A_LO=a_lo, DOT_F32=interpret,
            STAGES=OFFDIAG_STAGES, AIB=aib_in_state, num_warps=1, num_stages=1,
        )

    yield "intra_offdiag", intra_offdiag
    # u in float32 from the w/u kernel, or Aib's pair in its place
    u = aib if aib_in_state else torch.empty(nch, H, V, 64, dtype=torch.float32, device=dev)

    if not aib_in_state:
        BK, BVB = min(WU_BLOCK, K), min(WU_VALUE_BLOCK, V)
        rows_d = [rows_descriptor(x, [64, block]) for x, block in ((tk, BK), (tv, BVB))]
        gc_d = TensorDescriptor.from_tensor(gc.view(-1, K), [64, BK])
        ai_d = TensorDescriptor.from_tensor(ai.view(-1, 64), [64, 64])

        def intra_wu():
            fast(kda_intra_wu_kernel)[(nch, H)](
                bc, cu_t, idx, rn, gc, wqk, u, egl, *rows_d, gc_d, ai_d, H=H, K=K, V=V, BK=BK, BVB=BVB,
                PRECISION=LOCAL_PRECISION, STAGES=WU_STAGES, DOT_F32=interpret,
                W_LO=lo["W_LO"], NS=slots["NS"], num_warps=WU_WARPS, **register_cap(WU_MAXNREG),
            )

        yield "intra_wu", intra_wu
    wqk_d = TensorDescriptor.from_tensor(wqk.view(-1, K), [64, K])
    u_d = TensorDescriptor.from_tensor(u.view(-1, 64), [64 if aib_in_state else BV, 64])
    aqk_d = TensorDescriptor.from_tensor(aqk.view(-1, 64), [64, 64])
    state_d = TensorDescriptor.from_tensor(state.view(-1, V), [K, BV])
    if aib_in_state:
        device_descriptors()

    def state_pass():
        fast(kda_state_pass_kernel)[(cdiv(V, BV), (len(cu) - 1) * H)](
            wqk_d, u_d, aqk_d, egl, o, state_d, cu_t, offsets_t, slots_t, init_t, wqk, u, aqk, tv, tv.stride(0),
            cu_t if saves_t is None else saves_t, state,
            H=H, K=K, V=V, BV=BV, CHAIN=chain, **slots, A_LO=a_lo, L2_AHEAD=0 if interpret else STATE_L2_AHEAD,
            AIB=aib_in_state, DOT_F32=interpret, SAVE=saves_t is not None, num_warps=STATE_WARPS,
            num_stages=STATE_STAGES if saves_t is None else STATE_SAVE_STAGES,
        )

    yield "state", state_pass


def kda_prefill_chunk64(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate, saves_t=None):
    """Launch on arguments that prefill.py has validated (``cu`` on the host, the rest on the device);
    ``gate`` is ``(A_log, dt_bias, lower_bound)`` or None; ``saves_t`` the per-chunk checkpoint slots or None."""
    for _, launch in chunk64_launches(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate, saves_t):
        launch()
    return o
