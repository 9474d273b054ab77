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

CHAIN_PRECISIONS = ("bf16x3", "bf16x2", "bf16")
# float32 products in kernels A (the WY merge) and B (with Ai): Triton's precisions, or three bf16 products
# (``mm_f32``, kda_prefill_intra64_split.py)
PRODUCT_PRECISIONS = ("tf32x3", "ieee", "tf32", "bf16x3")
CHAIN_PRODUCTS = {"bf16x3": 3, "bf16x2": 2, "bf16": 1}


def copy_engine_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] (heads contiguous, any row stride) itself where its base and row stride are 16-byte
    aligned, as the copy engine needs, else a contiguous copy."""
    if x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    return x


def rows_descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A descriptor over ``x`` [T, H, D] (``copy_engine_rows``) as [T, H * D] rows in ``block`` tiles."""
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], block)


def v3_launches(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate, *, BV: int,
                num_warps: int, num_stages: int | None, chain_precision: str, local_precision: str,
                out_x3: bool = False, KS: int = 32, d_warps: int = 2, a_ks: int = 32,
                solve_precision: str | None = None, b_block: int = 32, b_value_block: int = 64,
                b_warps: int = 4, b_maxnreg: int | None = 168, b_precision: str | None = None,
                b_stages: int = 3, a_stages: int = 2, gate_block: int = 64, gate_warps: int = 2,
                state_l2_ahead: int | None = None, u_in_state: bool | None = None, d_maxnreg: int | None = 128,
                w_in_state: bool | None = None):
    """v3's launches as closures over freshly allocated scratch, yielded in order, each as soon as its scratch
    exists, so that a caller launching them as they come has the GPU running the first while the host prepares
    the next (the benchmark lists them and times them one by one). Each goes through ``launch.fast`` (the compiled
    kernel kept per configuration: no per-call binding by Triton). The defaults are the fastest measured on an
    H200 (bench/notes/kda_prefill.md); the options, launch by launch (the percentages measured there):

    - ``gate`` (kda_prefill_gate.py): the log-decay's chunk-relative cumulative sum and beta, once per chunk-head,
      which D, A and B read; ``gate_block`` key columns per program on ``gate_warps`` warps (64 on 2: 7% off the
      pass against 32 on 1).
    - ``intra_d`` (D, kda_prefill_intra64_split.py): the diagonal 16-token blocks and their inverses, and the
      state pass's qg and kd from the same tiles, over K in slices of ``KS`` (32: 5% faster than 16),
      ``d_warps`` warps per program (2: 4 are 25% slower), at most ``d_maxnreg`` registers per thread or None
      (128: eight programs per SM where its 166 fit six, 8 bytes of spills, 7-8% faster).
    - ``intra_a`` (A, kda_prefill_intra64_rows.py): the off-diagonal blocks per 16-row block and the merge per
      chunk, one warp, over K in slices of ``a_ks`` whose tiles the copy engine brings ``a_stages`` deep (slices
      of 16 three deep: 22-26% faster than loads by pointers; slices of 32 two deep: 2-6% faster again); the
      merge's products in ``solve_precision``.
    - ``intra_b`` (B, kda_prefill_intra64_b.py; not launched with ``w_in_state``): w (and u without
      ``u_in_state``), in key column blocks of
      ``b_block`` and value column blocks of ``b_value_block`` (64: 3% faster than 32 in a packed batch, level at
      T=8192), on ``b_warps`` warps with at most ``b_maxnreg`` registers per thread or None (168: three programs
      per SM instead of two without u_in_state, without spills; B without u takes 109, and 96 were no faster);
      its tiles by the copy engine, its column loops ``b_stages`` deep (3: 8% faster than loads by pointers; 2 no
      faster, 4 level); its products with Ai in ``b_precision``, by default
      ``local_precision`` ("bf16x3": the final state's error 35 times smaller without ``u_in_state``, for 7% more
      time in B).
    - ``state``: the sequential pass, ``num_stages`` of tiles in flight (by default as many as fit, 3 or 2), each
      step asking the L2 for the tiles of the step ``state_l2_ahead`` ahead (by default the next at 2 stages,
      none at 3).

    ``u_in_state`` (by default on wherever it fits: bf16 v and output, no ``out_x3``): kernel A writes ``Aib = Ai
    diag(beta)`` as a bf16 pair, kernel B forms w from it and leaves u out (its value loop, 48 of the 210 KB it
    moved per chunk-head), and the state pass forms u from v and Aib (two products a step more, off the chain).
    Aqk then keeps its hi half alone (shared memory): the output's error rises by about 30%, and u's own rounding
    leaves the chain (the final state's error against float64 35 times smaller at T=8192).

    ``w_in_state`` (by default with ``u_in_state``): kernel D writes ``-kg = -k exp(gc)`` into w's slots (from the
    tiles it holds for qg, no exponential more) and ``exp(gl)``, kernel B is not launched, and the state pass
    forms ``v' = u + Aib ((-kg) S)``: three products more a step, one of them on the chain. On an H200 the state
    pass +10%, D +20%, B's 0.23-0.24 ms at T=8192 gone: the call 7-10% faster, the errors against float64 equal to
    three digits (bench/notes/kda_prefill.md, "w's product in the state pass")."""
    if chain_precision not in CHAIN_PRECISIONS:
        raise ValueError(f"kda_prefill v3: chain_precision must be one of {CHAIN_PRECISIONS}, got {chain_precision!r}")
    T, H, K = q.shape
    V = v.shape[-1]
    if K & (K - 1) or V & (V - 1) or min(K, V) < 16 or BV & (BV - 1) or not 16 <= BV:
        raise ValueError(f"kda_prefill v3: K, V and BV must be powers of two >= 16, got K={K} V={V} BV={BV}")
    for name, cap in (("b_maxnreg", b_maxnreg), ("d_maxnreg", d_maxnreg)):
        if cap is not None and not 32 <= cap <= 255:
            raise ValueError(f"kda_prefill v3: {name} must be None or in [32, 255], got {cap}")
    for name, n in (("a_stages", a_stages), ("b_stages", b_stages)):
        if n < 1:
            raise ValueError(f"kda_prefill v3: {name} must be >= 1, got {n}")
    if gate_warps not in (1, 2, 4, 8):
        raise ValueError(f"kda_prefill v3: gate_warps must be 1, 2, 4 or 8, got {gate_warps}")
    for name, n in (("KS", KS), ("b_block", b_block), ("b_value_block", b_value_block), ("a_ks", a_ks),
                    ("gate_block", gate_block)):
        if n & (n - 1) or n < 16:
            raise ValueError(f"kda_prefill v3: {name} must be a power of two >= 16, got {n}")
    # u formed in the state pass needs bf16 v (its products) and a 16-bit output without out_x3 (shared memory)
    u_fits = v.dtype == torch.bfloat16 and o.element_size() == 2 and not out_x3
    if u_in_state is None:
        # on wherever it fits: the whole call 8-10% faster at the bf16x3 chain, 3-7% at bf16x2 (at two stages,
        # against bf16x2's three without it) on an H200 (bench/notes/kda_prefill.md, "u formed inside the state
        # pass, timed"); a float32 output's store takes the shared memory it would need
        u_in_state = u_fits
    elif u_in_state and not u_fits:
        raise ValueError(f"kda_prefill v3: u_in_state needs bf16 v (the state pass's products), a 16-bit output and "
                         f"no out_x3 (its shared memory), got v {v.dtype}, output {o.dtype}, out_x3={out_x3}")
    if w_in_state is None:
        w_in_state = u_in_state
    elif w_in_state and not u_in_state:
        raise ValueError("kda_prefill v3: w_in_state needs u_in_state (the state pass's v tiles and Aib)")
    if num_stages is None:
        # the state pass's tiles three steps deep where they fit the 227 KB of shared memory (sm_90, BV=64: 197 KB
        # at the bf16x2 chain without u_in_state; the bf16x3 chain's two more tile slots take 3 stages to 295 KB,
        # u_in_state's v and Aib tiles bf16x2's to 248 KB)
        narrow = CHAIN_PRODUCTS[chain_precision] < 3 and min(BV, V) <= 64
        num_stages = 3 if narrow and not (out_x3 or u_in_state) else 2
    if state_l2_ahead is None:
        # a step ahead at the two-deep ring: the state pass 6-9% faster at T=8192 and 3% at T=65536 on an H200,
        # level (+-3%) in a packed batch; the three-deep ring (bf16x2) has its copies a step ahead already, and the
        # prefetch made it 6-8% slower (bench/notes/kda_prefill.md, "The state pass's tiles asked of the L2 a step
        # ahead")
        state_l2_ahead = 1 if num_stages == 2 else 0
    if state_l2_ahead < 0:
        raise ValueError(f"kda_prefill v3: state_l2_ahead must be >= 0, got {state_l2_ahead}")
    if num_stages < 2 and not env.triton_interpret():
        # one stage faulted (illegal address) on an H200 with Triton 3.6 in a varlen batch, BV=32
        raise ValueError("kda_prefill v3: num_stages must be >= 2")
    BV = min(BV, V)
    if out_x3 and BV > 32:
        # qg's lo half is one more [64, K] bf16 tile per pipeline stage: 262 KB of shared memory at BV=64
        raise ValueError(f"kda_prefill v3: out_x3 needs BV <= 32 (the state pass's shared memory), got BV={BV}")
    dev = q.device
    idx, offsets_t, nch = chunk_tables(cu, 64, dev)  # cached per batch, no stream sync (varlen.py)
    if not nch:
        return
    # w, qg, kd and Aqk in bf16, each followed by its lo half where the chain (or out_x3) reads it
    chain = CHAIN_PRODUCTS[chain_precision]
    lo = {"W_LO": int(chain == 3), "Q_LO": int(out_x3), "KD_LO": int(chain == 3)}
    slots = dict(NS=3 + sum(lo.values()), SQ=1 + lo["W_LO"], SKD=2 + lo["W_LO"] + lo["Q_LO"])
    A_log, dt_bias, lower_bound = gate if gate is not None else (g, g, 0.0)
    gate_args = dict(GATE_IN_KERNEL=gate is not None, HAS_LOWER_BOUND=gate is not None and lower_bound is not None,
                     BETA_LOGITS=gate is not None)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    # the merge in three bf16 products unless everything is ieee: kernel A 5% faster than in tf32x3 on an H200 (T=8192
    # and 16 packed sequences), the final state's error at T=65536 and 131072 unchanged to three digits
    # (bench/results/kda_prefill_options.json, kda_precision.json)
    solve = solve_precision or ("ieee" if local_precision == "ieee" else "bf16x3")
    if solve not in PRODUCT_PRECISIONS:
        raise ValueError(f"kda_prefill v3: solve_precision must be one of {PRODUCT_PRECISIONS}, got {solve!r}")
    b_prec = b_precision or local_precision
    if b_prec not in PRODUCT_PRECISIONS:
        raise ValueError(f"kda_prefill v3: b_precision must be one of {PRODUCT_PRECISIONS}, got {b_prec!r}")
    gc = torch.empty(nch, H, 64, K, dtype=torch.float32, device=dev)
    bc = torch.empty(nch, H, 64, dtype=torch.float32, device=dev)
    GBK = min(gate_block, K)

    def gate_pass():
        fast(kda_gate_pass_kernel)[(nch * (K // GBK), H)](
            g, beta, A_log, dt_bias, lb, cu_t, idx, gc, bc, g.stride(0), beta.stride(0),
            H=H, K=K, BK=GBK, num_warps=gate_warps, **gate_args,
        )

    yield "gate", gate_pass
    # Aqk's lo half: the bf16x3 chain's precision, or out_x3's; with u_in_state the state pass's ring has no room for
    # it (231,552 of the 232,448 bytes of shared memory without it, 247,952 with it, compiled for sm_90)
    a_lo = int(out_x3 or (chain == 3 and not u_in_state))
    aqk = torch.empty(nch, H, 1 + a_lo, 64, 64, dtype=torch.bfloat16, device=dev)
    ai = torch.empty(nch, H, 64, 64, dtype=torch.float32, device=dev)
    rn = torch.empty(nch, H, 2, 64, dtype=torch.float32, device=dev)  # D's norm factors, read by A and B
    # Aib = Ai diag(beta) in bf16 hi + lo pairs (u_in_state), which kernel A writes for B and the state pass
    aib = torch.empty(nch, H, 2, 64, 64, dtype=torch.bfloat16, device=dev) if u_in_state else ai
    # D, A and B read the pass's scratch: one compiled reader for the plain and the gated op
    in_args = (q, k, gc, bc, cu_t, idx, aqk, ai, rn, q.stride(0), k.stride(0))
    # the state pass's tiles: qg and kd from D, w from B
    wqk = torch.empty(nch, H, slots["NS"], 64, K, dtype=torch.bfloat16, device=dev)
    egl = torch.empty(nch, H, K, dtype=torch.float32, device=dev)  # exp(gl): from D with w_in_state, else B

    def intra_diag():
        fast(kda_intra64_diag_kernel)[(nch * 4, H)](
            *in_args, K**-0.5, wqk, egl, H=H, K=K, KS=min(KS, K), LOCAL_PRECISION=local_precision, A_LO=a_lo,
            FAST_EXP=not env.triton_interpret(), **slots, Q_LO=lo["Q_LO"], KD_LO=lo["KD_LO"], KG=w_in_state,
            W_LO=lo["W_LO"], num_warps=d_warps, num_stages=1, **register_cap(d_maxnreg),
        )

    yield "intra_d", intra_diag

    AKS = min(a_ks, K)
    tq, tk, tv = (copy_engine_rows(x) for x in (q, k, v))  # A's and B's tiles come by the copy engine
    a_d = [rows_descriptor(tq, [16, AKS]), rows_descriptor(tk, [16, AKS]),
           TensorDescriptor.from_tensor(gc.view(-1, K), [16, AKS])]

    def intra_offdiag():
        # each [16, 16] product on mma.sync runs in every warp of the program: one warp executes the fewest
        # instructions (two warps with slices of 32, and a register cap, measured slower: bench/notes/kda_prefill.md,
        # "A per row block")
        fast(kda_intra64_offdiag_rows_kernel)[(nch, H)](
            bc, cu_t, idx, aqk, ai, rn, *a_d, aib, H=H, K=K, KS=AKS, LOCAL_PRECISION=local_precision,
            SOLVE_PRECISION=solve, FAST_EXP=not env.triton_interpret(), A_LO=a_lo, DOT_F32=env.triton_interpret(),
            STAGES=a_stages, AIB=u_in_state, num_warps=1, num_stages=1,
        )

    yield "intra_a", intra_offdiag
    # u in float32 from kernel B, or (u_in_state) Aib's pair from kernel A in its place
    u = aib if u_in_state else torch.empty(nch, H, V, 64, dtype=torch.float32, device=dev)

    BK, BVB = min(b_block, K), min(b_value_block, V)
    rows_d = [rows_descriptor(x, [64, block]) for x, block in ((tk, BK), (tv, BVB))]
    gc_d = TensorDescriptor.from_tensor(gc.view(-1, K), [64, BK])
    ai_d = TensorDescriptor.from_tensor(aib.view(-1, 64), [64, 64])  # Ai itself unless u_in_state

    def intra_b():
        fast(kda_intra64_b_kernel)[(nch, H)](
            bc, cu_t, idx, rn, gc, wqk, u, egl, *rows_d, gc_d, ai_d, H=H, K=K, V=V, BK=BK, BVB=BVB,
            PRECISION=b_prec, STAGES=b_stages, DOT_F32=env.triton_interpret(), AIB=u_in_state,
            W_LO=lo["W_LO"], NS=slots["NS"], num_warps=b_warps, **register_cap(b_maxnreg),
        )

    if not w_in_state:
        yield "intra_b", intra_b
    wqk_d = TensorDescriptor.from_tensor(wqk.view(-1, K), [64, K])
    u_d = TensorDescriptor.from_tensor(u.view(-1, 64), [64 if u_in_state else BV, 64])
    aqk_d = TensorDescriptor.from_tensor(aqk.view(-1, 64), [64, 64])
    state_d = TensorDescriptor.from_tensor(state.view(-1, V), [K, BV])
    if u_in_state:
        device_descriptors()

    def state_pass():
        fast(kda_state64_kernel)[(triton.cdiv(V, BV), (len(cu) - 1) * H)](
            wqk_d, u_d, aqk_d, egl, o, state_d, cu_t, offsets_t, slots_t, init_t, wqk, u, aqk, tv, tv.stride(0),
            H=H, K=K, V=V, BV=BV, CHAIN=chain, OUT_X3=out_x3, **slots, A_LO=a_lo,
            L2_AHEAD=0 if env.triton_interpret() else state_l2_ahead, U_IN_STATE=u_in_state, W_IN_STATE=w_in_state,
            DOT_F32=env.triton_interpret(), num_warps=num_warps, num_stages=num_stages,
        )

    yield "state", state_pass


def kda_prefill_v3(q, k, v, g, beta, o, state, cu: list[int], cu_t, slots_t, init_t, gate, **options):
    """Launch v3 on arguments that kda_prefill.py has validated (``cu`` on the host, the rest on the device);
    ``gate`` is ``(A_log, dt_bias, lower_bound)`` or None; ``options`` as for ``v3_launches``."""
    for _, launch in v3_launches(q, k, v, g, beta, o, state, cu, cu_t, slots_t, init_t, gate, **options):
        launch()
    return o
