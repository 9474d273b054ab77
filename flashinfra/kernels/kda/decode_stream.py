"""The state kernels of the KDA layer decode's streaming layouts (``grid="stream"`` / ``"tiles"`` in
``kda_layer_decode_launch``).

The prep kernel (``kda_layer_decode_prep_kernel`` with ``PREP_V``) has already written each head's q, k,
decay, v conv output and beta into a float32 scratch ``heads`` [B * H, 5, R] and shifted the whole conv
slot, so a state program reads nothing but the scratch (from L2) and its [K, BV] state tile, and writes the
tile back in place and its [BV] unnormalised output; the norm kernel follows, except where a tile is a
head's whole row (``stream`` and ``tiles`` then apply the gated RMSNorm themselves).

``stream`` is persistent: a grid of as many programs per SM as fit walks the (sequence, head, V block) tiles
t = pid, pid + G, ..., so that later tiles' states are on their way while the current one is reduced. The
state is a tensor descriptor over [slots * H, K, V], loaded by the copy engine in a ``tl.range`` loop of
``STAGES`` stages, which Triton's pipeliner turns into a ring of STAGES - 1 shared-memory buffers (STAGES - 2
loads in flight while a tile is computed); the new tile leaves by the copy engine through a staging buffer or
by plain stores.

``tiles`` is the same state step without persistence: one program per tile (the bare recurrence's shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashinfra.kernels.dispatch import interpreting, register_cap
from flashinfra.kernels.kda.decode_recurrence import blocks_inside
from flashinfra.kernels.kda.common import (gate_apply, load_state, state_step, state_step_dot, state_tile,
                                                      store_state)


@triton.jit
def _head_rows(heads, i_bh, o_k, o_v, R: tl.constexpr):
    """A tile's rows of the prep scratch: q (scaled), k, decay over K, its V block of v, and beta; read with
    the L2 policy evict_first (the other V blocks of the head read them at about the same time, then they
    are dead), which also demotes lines the prep launch wrote with evict_last."""
    p_h = heads + i_bh * (5 * R)
    b_q = tl.load(p_h + o_k, eviction_policy="evict_first")
    b_k = tl.load(p_h + R + o_k, eviction_policy="evict_first")
    b_decay = tl.load(p_h + 2 * R + o_k, eviction_policy="evict_first")
    b_v = tl.load(p_h + 3 * R + o_v, eviction_policy="evict_first")
    return b_q, b_k, b_decay, b_v, tl.load(p_h + 4 * R, eviction_policy="evict_first")


@triton.jit
def kda_layer_decode_stream_kernel(
    state_d, heads, state_slots, out, tiles, state, gate, norm_w, eps, stride_gate,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr,
    STAGES: tl.constexpr, TMA_STORE: tl.constexpr, NORM: tl.constexpr,
):
    """Grid (G,), G <= tiles: program p takes tiles p, p + G, ...; ``state_d`` is a descriptor over the
    state viewed as [slots * H, K, V] with block [1, BK, BV] (rows past K and columns past V are filled
    with zeros on load and dropped on store). The new tile leaves by the copy engine (``TMA_STORE``,
    through a shared-memory staging buffer) or by plain stores from registers (one buffer less, so more
    programs fit). With ``NORM`` (a tile is a head's whole row, BV >= V) the gated RMSNorm is applied
    here and the norm launch is left out."""
    NV: tl.constexpr = (V + BV - 1) // BV
    o_k = tl.arange(0, BK)
    o_b = tl.arange(0, BV)
    for t in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
        i_bh = t // NV
        i_v = t - i_bh * NV
        i_h = i_bh % H
        slot = tl.load(state_slots + i_bh // H)
        row = slot.to(tl.int32) * H + i_h
        b_s = state_d.load([row, 0, i_v * BV]).reshape(BK, BV).to(tl.float32)
        o_v = i_v * BV + o_b
        m_v = o_v < V
        b_q, b_k, b_decay, b_v, b_beta = _head_rows(heads, i_bh, o_k, o_v, R)
        b_s, b_o = state_step(b_s, b_q, b_k, b_decay, b_beta, b_v)
        if NORM:
            b_o = _gated_norm_row(b_o, gate + (i_bh // H) * stride_gate + i_h * V, norm_w, eps, o_v, m_v, V,
                                  out.dtype.element_ty)
        tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
        if TMA_STORE:
            state_d.store([row, 0, i_v * BV], b_s.to(state_d.dtype).reshape(1, BK, BV))
        else:
            p_s, m_s = state_tile(state, slot.to(tl.int64), i_h, o_k, o_v, H, K, V)
            tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)


@triton.jit
def _gated_norm_row(b_o, gate_row, norm_w, eps, o_v, m_v, V: tl.constexpr, ODT: tl.constexpr):
    """The gated RMSNorm of a head's whole output row held by the program (columns past V hold zeros: the
    zero-filled state and zero v give a zero output there), rounded first as the norm launch would read it."""
    b_o = b_o.to(ODT).to(tl.float32)
    return gate_apply(b_o / tl.sqrt(tl.sum(b_o * b_o) / V + eps), gate_row, norm_w, o_v, m_v)


@triton.jit
def kda_layer_decode_tile_kernel(
    state, heads, state_slots, out, gate, norm_w, eps, stride_gate,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr,
    NORM: tl.constexpr, DOT_SUMS: tl.constexpr = False, DOT_F32: tl.constexpr = False, EVEN: tl.constexpr = False,
):
    """Grid (cdiv(V, BV), B * H): one [K, BV] tile per program, nothing but the prep scratch and the tile
    read (the bare recurrence's shape); with ``NORM`` (BV >= V, a tile is a head's whole row) the gated
    RMSNorm is applied here and the norm launch is left out. DOT_SUMS (a bf16 state): ``state_step_dot``;
    EVEN (BK == K and BV divides V): every tile inside the state, no masks."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = (o_v < V) | EVEN  # a constant mask, folded away, where EVEN
    p_s, m_s = state_tile(state, tl.load(state_slots + i_bh // H).to(tl.int64), i_bh % H, o_k, o_v, H, K, V)
    b_s = load_state(p_s, m_s, not EVEN)
    if not DOT_SUMS:
        b_s = b_s.to(tl.float32)
    b_q, b_k, b_decay, b_v, b_beta = _head_rows(heads, i_bh, o_k, o_v, R)
    if DOT_SUMS:
        b_s, b_o = state_step_dot(b_s, b_q, b_k, b_decay, b_beta, b_v, BV, DOT_F32)
    else:
        b_s, b_o = state_step(b_s, b_q, b_k, b_decay, b_beta, b_v)
    if NORM:
        b_o = _gated_norm_row(b_o, gate + (i_bh // H) * stride_gate + (i_bh % H) * V, norm_w, eps, o_v, m_v, V,
                              out.dtype.element_ty)
    tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    store_state(p_s, b_s, m_s, not EVEN)


def fit_per_sm(n_regs: int, shared: int, num_warps: int, regs_per_sm: int = 65536, smem_per_sm: int = 233472,
               threads_per_sm: int = 2048) -> int:
    """How many programs fit on one SM at once (registers allocated per warp in units of 256, 1 KB of shared
    memory reserved per program, at most 32 programs): a persistent grid larger than that would leave its
    last programs to start only when others end."""
    warp_regs = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (warp_regs * num_warps)
    return max(1, min(by_regs, smem_per_sm // (shared + 1024), threads_per_sm // (32 * num_warps), 32))


_FIT: dict[tuple, int] = {}


def persistent_grid(kernel, args: tuple, kw: dict, work: int, device: torch.device, per_sm: int | None,
                    programs: int | None) -> int:
    """Grid size of a persistent kernel over ``work`` items: ``programs`` if given, else as many programs per SM
    as fit (at most ``per_sm``), learnt once per compiled configuration from its registers and shared memory.
    Under the CPU interpreter, 4 programs, so that each walks several items at test sizes."""
    if programs is None:
        if device.type == "cuda":
            key = (kernel.fn.__name__, device.index, *(a.dtype for a in args if isinstance(a, torch.Tensor)),
                   *sorted(kw.items()))
            if key not in _FIT:
                compiled = kernel.warmup(*args, grid=(1,), **kw)
                compiled = compiled.result() if hasattr(compiled, "result") else compiled  # an asynchronous compile
                compiled._init_handles()  # loads the binary, which is where Triton learns its register count
                props = torch.cuda.get_device_properties(device)
                _FIT[key] = fit_per_sm(compiled.n_regs, compiled.metadata.shared, kw["num_warps"],
                                       getattr(props, "regs_per_multiprocessor", 65536),
                                       getattr(props, "shared_memory_per_multiprocessor", 233472),
                                       props.max_threads_per_multi_processor)
            fit, sms = _FIT[key], torch.cuda.get_device_properties(device).multi_processor_count
        else:
            fit, sms = 2, 2
        programs = sms * min(fit, per_sm or fit)
    return max(1, min(work, programs))


def check_stream_layout(state: torch.Tensor, BV: int, BK: int) -> None:
    """The copy engine's constraints on the state descriptor (16-byte aligned base and row stride, a block
    row of at least 16 bytes), as a clear error instead of an assertion deep in Triton."""
    e = state.element_size()
    V = state.shape[-1]
    if state.data_ptr() % 16 or (V * e) % 16 or BV * e < 16 or max(BK, BV) > 256:
        raise ValueError(f"kda_layer_decode: grid 'stream' needs a 16-byte aligned state with V * {e} bytes a "
                         f"multiple of 16, BV * {e} >= 16 bytes and K, BV <= 256 (V={V}, BV={BV}, BK={BK})")


def stream_state_launch(state: torch.Tensor, heads: torch.Tensor, state_slots: torch.Tensor, out: torch.Tensor,
                        gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, grid: str, BV: int, R: int,
                        num_warps: int, num_stages: int, per_sm: int | None, programs: int | None,
                        tma_store: bool, maxnreg: int | None = None, dot_sums: bool = False) -> bool:
    """Run the state kernel of ``grid`` over every tile of the batch: "stream" with a persistent grid
    (``programs`` programs if given, else as many per SM as fit, at most ``per_sm``), "tiles" with one
    program per tile. Returns whether the gated RMSNorm was applied too (a tile is a head's
    whole row). ``dot_sums``: the tiles kernel's ``DOT_SUMS``."""
    B = out.shape[0]
    H, K, V = state.shape[1:]
    BK = triton.next_power_of_2(K)
    tiles = B * H * triton.cdiv(V, BV)
    norm = grid in ("stream", "tiles") and BV >= V
    cap = register_cap(maxnreg)
    if grid == "tiles":
        kda_layer_decode_tile_kernel[(triton.cdiv(V, BV), B * H)](
            state, heads, state_slots, out, gate, norm_weight, float(eps), gate.stride(0), H=H, K=K, V=V, BK=BK,
            BV=BV, R=R, NORM=norm, DOT_SUMS=dot_sums, DOT_F32=interpreting(),
            EVEN=blocks_inside(K, V, BK, BV), num_warps=num_warps, **cap)
        return norm
    check_stream_layout(state, BV, BK)
    kernel = kda_layer_decode_stream_kernel
    args = (TensorDescriptor.from_tensor(state.view(-1, K, V), [1, BK, BV]), heads, state_slots, out, tiles, state,
            gate, norm_weight, float(eps), gate.stride(0))
    kw = dict(H=H, K=K, V=V, BK=BK, BV=BV, R=R, STAGES=num_stages, TMA_STORE=tma_store, NORM=norm,
              num_warps=num_warps, num_stages=num_stages, **cap)
    kernel[(persistent_grid(kernel, args, kw, tiles, out.device, per_sm, programs),)](*args, **kw)
    return norm


PLAIN4 = dict(num_stages=4, tma_store=False)  # four stages, new state written by plain stores
# (grid, BV, num_warps, launch options) of the streaming layouts worth comparing: bench/kda_decode.py times each at
# every batch size and state dtype, tests/kernels/test_kda_gpu.py runs each (bench/notes/kda_decode.md; one-warp
# tiles, [K, 32] on 4 warps and 3 stages were no faster than these in the 05:04 UTC run)
STREAM_VARIANTS = [("stream", 64, 4, dict(num_stages=4)), ("stream", 32, 2, dict(num_stages=4)),
                   ("stream", 64, 4, PLAIN4), ("stream", 64, 4, dict(PLAIN4, num_stages=5)),
                   ("stream", 64, 4, dict(PLAIN4, num_stages=6)), ("stream", 32, 2, PLAIN4),
                   ("stream", 32, 2, dict(PLAIN4, num_stages=5)), ("stream", 128, 4, PLAIN4),
                   ("stream", 64, 4, dict(PLAIN4, scratch_l2=True)), ("tiles", 64, 4, {}),
                   ("tiles", 32, 2, {}), ("tiles", 32, 4, {}), ("tiles", 64, 4, dict(maxnreg=96)),
                   ("tiles", 128, 8, {})]
