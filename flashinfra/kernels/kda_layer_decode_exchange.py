"""The KDA layer decode's launches overlapped (the prep layout in ``kda_layer_decode_launch``):
``norm_overlap=True`` runs the norm launch during the state launch, ``prep_overlap=True`` (with it) also the
state launch during the prep launch.

The norm launch needs a head's whole output row, which the state launch's programs of that head write. In
stream order it starts after the state launch's last program has ended, and it takes 3-5 us at B=64 on an
H200. Meanwhile the state launch's last wave leaves SMs idle: its 8192 programs fill 15.5 waves of four per SM.
Here the norm launch is a programmatic dependent of the state launch. Every state program signals
``launch_dependents`` as it starts, so the norm programs are scheduled once the last wave has started, onto the
slots the finished state programs free.

A dependent launch makes the state launch's writes visible only through ``griddepcontrol.wait``, which waits
for the whole state launch. So each head's output row goes through an exchange buffer of tagged words instead.
- Each 64-bit word holds a float32 output value in its low half and the call's tag in its high half.
- The state program writes its words by relaxed atomic exchange, which needs no fence.
- The norm program polls its row with volatile loads until every word carries the call's tag, then reads the
  values from the same words (the scheme of NCCL's low-latency protocol).
- The tag is a device counter plus one, read by every launch of the call. The norm program that finishes last
  advances the counter for the next call. Nothing is reset between calls: a stale word carries an older tag.
- The polling is bounded (``MAX_POLLS``): a row that never gets its words is normalised as NaN, so a broken
  exchange shows in the output instead of hanging the device.
- Each norm program ends with ``griddepcontrol.wait``, so the norm launch ends only after the state launch does,
  and the stream's next work may rely on both.

The prep launch (9.9 us at B=64) runs its 4096 programs in two waves. With ``prep_overlap`` every prep program
signals ``launch_dependents`` as it starts, so the state launch, its dependent, begins during the second wave.
- A prep program raises its heads' flags to the call's tag by a release once their rows and conv slot are
  written. It has nothing left to do, so waiting for its own stores costs it nothing.
- A state program issues its state load first, then waits for its head's flag by acquire loads, then reads the
  rows. That head's prep program has started: the state launch began only after every prep program had.
- A flag that never comes gives the head a NaN beta, so its output and state show it.
- The state launch ends with ``griddepcontrol.wait``, for the same reason as the norm launch.

The counter, the done count, the exchange buffer and the flags are one set per device. Every KDA layer shares
it (the layers' decode calls run one after the other), and it grows to the largest batch seen; a buffer it
outgrows stays allocated for the CUDA graphs captured with it. It must exist before a graph is captured: an
eager call of the same batch size first makes it, as the engine's warm-up before each capture does. A replay
then advances the counter on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashinfra import env
from flashinfra.kernels.kda_layer_decode_parts import gate_apply

# About 0.2 s of polling at L2 latency, thousands of times the longest wait the launches make (a norm program waits
# at most for one wave of the state launch, a state program for one prep program: each about 10 us on an H200),
# and short enough that a broken exchange cannot hold the device for long (at B=256 the state launch is 62 waves).
MAX_POLLS = 1 << 18


def max_polls() -> int:
    """MAX_POLLS, or 2 under the interpreter, which runs the launches one after another: there every word and
    flag is written before it is first read, and a broken exchange fails fast."""
    return 2 if env.triton_interpret() else MAX_POLLS


_EXCHANGE: dict[torch.device, dict[str, torch.Tensor]] = {}
# Buffers replaced by larger ones stay allocated: a CUDA graph captured with one keeps its address.
_RETIRED: list[torch.Tensor] = []


def exchange_buffers(device: torch.device, heads: int, V: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``xchg`` int64 [>= heads * V]: the output rows' words; ``counters`` int64 [2]: the tag counter and the
    norm launch's done count; ``flags`` int64 [>= heads]: the prep launch's per-head flags, ``prep_overlap``) for
    ``device``, zero-filled when made or grown. Growing them during a CUDA graph capture is refused: the replays
    would keep an allocation the capture's pool owns. A grown buffer's predecessor is kept, not freed, for the
    graphs captured with it."""
    bufs = _EXCHANGE.setdefault(device, {})
    for name, words in (("counters", 2), ("xchg", heads * V), ("flags", heads)):
        if name not in bufs or bufs[name].numel() < words:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("kda_layer_decode: the overlapped launches' exchange buffers must exist before a "
                                   "CUDA graph capture; run one eager call of this batch size first")
            if name in bufs:
                _RETIRED.append(bufs[name])
            bufs[name] = torch.zeros(words, dtype=torch.int64, device=device)
    return bufs["xchg"], bufs["counters"], bufs["flags"]


@triton.jit
def tag_store(p, x, tag, m):
    """The float32 values ``x`` into the words at ``p``, each with ``tag`` in its high half, by relaxed atomic
    exchange (one morally strong 64-bit write per word, no fence)."""
    word = ((tag & 0xFFFFFFFF) << 32) | (x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
    tl.atomic_xchg(p, word, mask=m, sem="relaxed", scope="gpu")


@triton.jit
def _missing(w, tag, m):
    """How many of the words ``w`` (where ``m``) do not carry ``tag``."""
    return tl.sum((m & (((w >> 32) & 0xFFFFFFFF) != (tag & 0xFFFFFFFF))).to(tl.int32))


@triton.jit
def tag_wait(p, tag, m, MAX_POLLS: tl.constexpr):
    """Poll the words at ``p`` until each carries ``tag``; their float32 values, or NaN everywhere if some word
    still lacked the tag after MAX_POLLS loads."""
    w = tl.load(p, mask=m, other=0, volatile=True)
    n = 0
    while (_missing(w, tag, m) > 0) & (n < MAX_POLLS):
        w = tl.load(p, mask=m, other=0, volatile=True)
        n += 1
    x = (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(_missing(w, tag, m) > 0, float("nan"), x)


@triton.jit
def flag_wait(p, tag, MAX_POLLS: tl.constexpr):
    """Wait (acquire) until the flag at ``p`` is ``tag`` or MAX_POLLS reads have been made; whether it was."""
    f = tl.atomic_add(p, 0, sem="acquire", scope="gpu")
    n = 0
    while (f != tag) & (n < MAX_POLLS):
        f = tl.atomic_add(p, 0, sem="acquire", scope="gpu")
        n += 1
    return f == tag


@triton.jit
def state_begin(counters, EXCHANGE: tl.constexpr, WAIT_PREP: tl.constexpr, PDL: tl.constexpr):
    """A state program's start: with ``PDL`` and ``EXCHANGE`` the norm launch may be scheduled once every state
    program has begun; the call's tag (0 when neither option is on)."""
    if PDL and EXCHANGE:
        gdc_launch_dependents()
    tag = tl.zeros([], tl.int64)
    if EXCHANGE or WAIT_PREP:
        tag = tl.load(counters) + 1
    return tag


@triton.jit
def state_rows_ready(flags, i_bh, tag, WAIT_PREP: tl.constexpr, MAX_POLLS: tl.constexpr):
    """Before a state program reads its head's prep rows: with ``WAIT_PREP`` wait for the head's flag; whether
    the rows are there (always with the option off)."""
    ready = True
    if WAIT_PREP:
        ready = flag_wait(flags + i_bh, tag, MAX_POLLS)
    return ready


@triton.jit
def state_output(out, xchg, i_bh, o_v, m_v, b_o, tag, V: tl.constexpr, EXCHANGE: tl.constexpr):
    """A state program's [BV] output, rounded to out's dtype: into ``out``, or with ``EXCHANGE`` into the exchange
    buffer's tagged words for the overlapped norm launch."""
    if EXCHANGE:
        tag_store(xchg + i_bh * V + o_v, b_o.to(out.dtype.element_ty).to(tl.float32), tag, m_v)
    else:
        tl.store(out + i_bh * V + o_v, b_o.to(out.dtype.element_ty), mask=m_v)


@triton.jit
def state_end(WAIT_PREP: tl.constexpr, PDL: tl.constexpr):
    """A state program's end: a launch that started before the prep launch ended ends only after it."""
    if PDL and WAIT_PREP:
        gdc_wait()


@triton.jit
def kda_layer_decode_norm_exchange_kernel(
    xchg, counters, gate, norm_w, eps, out, stride_gate,
    H: tl.constexpr, V: tl.constexpr, BVF: tl.constexpr, MAX_POLLS: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (B * H,): the gated RMSNorm of one head's output row, read from the exchange buffer once the state
    launch has written it there with this call's tag; the last program to finish advances the tag counter."""
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    tag = tl.load(counters) + 1
    o_f = tl.arange(0, BVF)
    m_f = o_f < V
    b_o = tag_wait(xchg + i_bh * V + o_f, tag, m_f, MAX_POLLS)
    b_o = gate_apply(b_o / tl.sqrt(tl.sum(b_o * b_o) / V + eps), gate + i_b * stride_gate + i_h * V, norm_w, o_f,
                     m_f)
    tl.store(out + i_bh * V + o_f, b_o.to(out.dtype.element_ty), mask=m_f)
    # every program has read the counter before adding itself to the done count: the last one moves the tag on
    if tl.atomic_add(counters + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(counters + 1, 0)
        tl.store(counters, tag)
    if PDL:
        gdc_wait()


def norm_exchange_launch(xchg, counters, gate, norm_weight, eps, out, H: int, V: int, pdl: bool) -> None:
    """The overlapped norm launch (after a state launch that wrote ``xchg`` with ``tag_store``); ``pdl`` makes it
    a programmatic dependent of that launch (CUDA; the interpreter runs the two launches in order)."""
    B = out.shape[0]
    kda_layer_decode_norm_exchange_kernel[(B * H,)](
        xchg, counters, gate, norm_weight, float(eps), out, gate.stride(0), H=H, V=V,
        BVF=triton.next_power_of_2(V), MAX_POLLS=max_polls(), PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}))
