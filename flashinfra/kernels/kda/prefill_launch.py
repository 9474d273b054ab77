"""KDA prefill (v3): 64-token chunks; the gate pass first (kda_prefill_gate.py: the log-decay's chunk-relative
cumulative sum and beta, once per chunk and head, which the in-chunk kernels read), the in-chunk pass in
parallel (the in-chunk matrices: the diagonal blocks, with the per-chunk tiles qg, kd and -kg from the same
loads, kda_prefill_intra64_split.py, and the off-diagonal ones per 16-row block with the merge into the inverse,
kda_prefill_intra64_rows.py; the tile w, kda_prefill_intra64_b.py, only where the state pass does not apply w's
product itself), then one sequential pass per (value block, sequence, head) that carries the state.

The state pass (``kda_state64_kernel``, kda_prefill_state_pass.py) carries the state through each sequence's
chunks in float32 registers, its chain of products in ``chain_precision`` ("bf16x3" by default: every operand
of the products that carry the state from chunk to chunk as a bf16 hi + lo pair).

Same semantics and arguments as ``kda_prefill_split`` (kda_prefill.py validates them). Scratch per chunk and
head: ``64 (2 K slots + 384) + 4 K`` bytes, 3 slots (bf16x2, bf16), 5 (bf16x3), one more with ``out_x3``; then
Aib's 16 KB (``u_in_state``), or u's ``256 V`` bytes and 8 KB more for Aqk's lo half (bf16x3, out_x3); the gate
pass's ``256 (K + 1)`` and the norm factors' 512 bytes more.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from flashinfra import env
from flashinfra.kernels.dispatch import register_cap
from flashinfra.kernels.kda.prefill_gate import kda_gate_pass_kernel
from flashinfra.kernels.kda.prefill_intra_w import kda_intra64_b_kernel
from flashinfra.kernels.kda.prefill_intra_offdiag import kda_intra64_offdiag_rows_kernel
from flashinfra.kernels.kda.prefill_intra_diag import kda_intra64_diag_kernel
from flashinfra.kernels.kda.prefill_state import kda_state64_kernel
from flashinfra.kernels.launch import device_descriptors, fast
from flashinfra.kernels.varlen import chunk_tables

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
# the diagonal blocks: K slices of 32 on 2 warps, at most 128 registers (eight programs per SM)
DIAG_KS, DIAG_WARPS, DIAG_MAXNREG = 32, 2, 128
# the off-diagonal blocks: K slices of 32 by the copy engine, two deep
OFFDIAG_KS, OFFDIAG_STAGES = 32, 2
# w and u (fp16): key blocks of 32, value blocks of 64, three deep, on 4 warps capped at 168 registers
WU_BLOCK, WU_VALUE_BLOCK, WU_WARPS, WU_MAXNREG, WU_STAGES = 32, 64, 4, 168, 3
# the gate pass: 64 key columns per program on 2 warps
GATE_BLOCK, GATE_WARPS = 64, 2


def copy_engine_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] (heads contiguous, any row stride) itself where its base and row stride are 16-byte
    aligned, as the copy engine needs, else a contiguous copy."""
    if x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    return x


def rows_descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A descriptor over ``x`` [T, H, D] (``copy_engine_rows``) as [T, H * D] rows in ``block`` tiles."""
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], block)


def v3_launches(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate):
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
        fast(kda_intra64_diag_kernel)[(nch * 4, H)](
            *in_args, K**-0.5, wqk, egl, H=H, K=K, KS=min(DIAG_KS, K), LOCAL_PRECISION=LOCAL_PRECISION, A_LO=a_lo,
            FAST_EXP=not interpret, **slots, KD_LO=lo["KD_LO"], KG=aib_in_state, W_LO=lo["W_LO"],
            num_warps=DIAG_WARPS, num_stages=1, **register_cap(DIAG_MAXNREG),
        )

    yield "intra_d", intra_diag

    AKS = min(OFFDIAG_KS, K)
    tq, tk, tv = (copy_engine_rows(x) for x in (q, k, v))  # tiles by the copy engine
    a_d = [rows_descriptor(tq, [16, AKS]), rows_descriptor(tk, [16, AKS]),
           TensorDescriptor.from_tensor(gc.view(-1, K), [16, AKS])]

    def intra_offdiag():
        # each [16, 16] product on mma.sync runs in every warp of the program: one warp executes the fewest
        # instructions
        fast(kda_intra64_offdiag_rows_kernel)[(nch, H)](
            bc, cu_t, idx, aqk, ai, rn, *a_d, aib, H=H, K=K, KS=AKS, LOCAL_PRECISION=LOCAL_PRECISION,
            SOLVE_PRECISION=SOLVE_PRECISION, FAST_EXP=not interpret, A_LO=a_lo, DOT_F32=interpret,
            STAGES=OFFDIAG_STAGES, AIB=aib_in_state, num_warps=1, num_stages=1,
        )

    yield "intra_a", intra_offdiag
    # u in float32 from the w/u kernel, or Aib's pair in its place
    u = aib if aib_in_state else torch.empty(nch, H, V, 64, dtype=torch.float32, device=dev)

    if not aib_in_state:
        BK, BVB = min(WU_BLOCK, K), min(WU_VALUE_BLOCK, V)
        rows_d = [rows_descriptor(x, [64, block]) for x, block in ((tk, BK), (tv, BVB))]
        gc_d = TensorDescriptor.from_tensor(gc.view(-1, K), [64, BK])
        ai_d = TensorDescriptor.from_tensor(ai.view(-1, 64), [64, 64])

        def intra_b():
            fast(kda_intra64_b_kernel)[(nch, H)](
                bc, cu_t, idx, rn, gc, wqk, u, egl, *rows_d, gc_d, ai_d, H=H, K=K, V=V, BK=BK, BVB=BVB,
                PRECISION=LOCAL_PRECISION, STAGES=WU_STAGES, DOT_F32=interpret,
                W_LO=lo["W_LO"], NS=slots["NS"], num_warps=WU_WARPS, **register_cap(WU_MAXNREG),
            )

        yield "intra_b", intra_b
    wqk_d = TensorDescriptor.from_tensor(wqk.view(-1, K), [64, K])
    u_d = TensorDescriptor.from_tensor(u.view(-1, 64), [64 if aib_in_state else BV, 64])
    aqk_d = TensorDescriptor.from_tensor(aqk.view(-1, 64), [64, 64])
    state_d = TensorDescriptor.from_tensor(state.view(-1, V), [K, BV])
    if aib_in_state:
        device_descriptors()

    def state_pass():
        fast(kda_state64_kernel)[(triton.cdiv(V, BV), (len(cu) - 1) * H)](
            wqk_d, u_d, aqk_d, egl, o, state_d, cu_t, offsets_t, slots_t, init_t, wqk, u, aqk, tv, tv.stride(0),
            H=H, K=K, V=V, BV=BV, CHAIN=chain, **slots, A_LO=a_lo, L2_AHEAD=0 if interpret else STATE_L2_AHEAD,
            AIB=aib_in_state, DOT_F32=interpret, num_warps=STATE_WARPS, num_stages=STATE_STAGES,
        )

    yield "state", state_pass


def kda_prefill_v3(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate):
    """Launch on arguments that prefill.py has validated (``cu`` on the host, the rest on the device);
    ``gate`` is ``(A_log, dt_bias, lower_bound)`` or None."""
    for _, launch in v3_launches(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate):
        launch()
    return o
