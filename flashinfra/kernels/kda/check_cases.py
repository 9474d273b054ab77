"""Correctness cases of the KDA and conv kernels, shared by the registered checks (checks.py, fixed sizes) and the
tests (tests/kernels: the interpreter's small sizes, the GPU's real ones). Each runs a Triton launcher on fresh
random inputs, its output poisoned (NaN) before the run, against a reference computed in float64, checks the
state slots outside the batch untouched, and checks a variable-length batch against a per-sequence loop; it
returns its ``CheckResult``s (failed ones included) instead of raising.
"""

from __future__ import annotations

import itertools
import math
import unittest.mock

import torch
import torch.nn.functional as F

from flashinfra.feedback.registry import CheckResult, compare
from flashinfra.kernels.kda import conv, decode, prefill
from flashinfra.kernels.kda import ref as kda_ref

NAN = float("nan")


def close(name: str, out, ref, rel: float, atol: float, rtol: float) -> CheckResult:
    """``compare`` with a bound on the relative norm of the error too."""
    r = compare(name, out, ref, atol=atol, rtol=rtol)
    if r.passed and r.rel_norm > rel:
        r.passed = False
        r.message = f"rel_norm above {rel:g}"
    return r


def same(name: str, out: torch.Tensor, ref: torch.Tensor) -> CheckResult:
    """Bit for bit (NaN matching NaN)."""
    ok = out.shape == ref.shape and bool(((out == ref) | (out.isnan() & ref.isnan())).all())
    return CheckResult(name=name, passed=ok, numel=out.numel(), shape=tuple(out.shape),
                       message="" if ok else "differs")


def tolerances(dtype: torch.dtype, device: str) -> tuple[float, float, float]:
    """(rel_norm, atol, rtol) for an output in ``dtype``: interpreter dots are fp32, GPU in-chunk dots tf32."""
    if dtype in (torch.bfloat16, torch.float16):
        return 8e-3, 2e-2, 2e-2
    return (2e-5, 1e-5, 1e-4) if device == "cpu" else (2e-3, 5e-3, 5e-3)


def offsets(lens):
    return [0] + list(itertools.accumulate(lens))


def f64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def prefill_varlen(device: str, lens: list[int], H: int, K: int, V: int, dtype=torch.float32, gated=False,
                   lower_bound=-5.0, seed=0, decay=5.0, row_pad=0, state_dtype=torch.float32) -> list[CheckResult]:
    """``kda_prefill_launch`` (or the gated twin) on a packed batch against the per-sequence float64 reference.
    ``decay`` scales the log-decay (the gate's rate when gated): small values keep a long memory, so that
    products between distant tokens of a chunk matter. ``row_pad``: q, k and v as views of rows that many
    elements longer (a row stride other than H * D). ``state_dtype`` bfloat16: the slots in bf16, the reference
    starting from their bf16 values and its final state rounded to bf16 once, where the kernel stores it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N = sum(lens), len(lens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k, v = (rnd(T, H * D + row_pad)[:, :H * D].unflatten(1, (H, D)) for D in (K, K, V))
    num_slots = N + 2
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:N].tolist()
    init = [bool(i % 2) for i in range(N)]
    state = rnd(num_slots, H, K, V, dt=state_dtype)
    for s, i in zip(slots, init):
        if not i:
            state[s] = NAN  # a fresh sequence must ignore its slot's content
    before = state.clone()
    if gated:
        g_in, b_in = rnd(T, H, K), rnd(T, H)
        A_log, dt_bias = rnd(H, dt=torch.float32) * 0.3 + math.log(decay / 5.0), rnd(H * K, dt=torch.float32)
    else:
        g_in = (-decay * torch.sigmoid(rnd(T, H, K, dt=torch.float32))).float()
        b_in = torch.rand(T, H, device=device, generator=gen)
    out = torch.full((T, H, V), NAN, dtype=dtype, device=device)
    if gated:
        prefill.kda_prefill_gated_launch(q, k, v, g_in, b_in, A_log, dt_bias, lower_bound, state, offsets(lens),
                                         slots, init, out=out)
    else:
        prefill.kda_prefill_launch(q, k, v, g_in, b_in, state, offsets(lens), slots, init, out=out)
    rel, atol, rtol = tolerances(dtype, device)
    state_tol = (2e-5, 1e-4, 1e-3) if device == "cpu" else (2e-3, 2e-3, 2e-3)
    if not prefill.float32_path(q.dtype, K, V) and device == "cpu":
        # bf16 hi + lo pairs keep about 16 bits (the interpreter rounds to bf16 by truncation)
        state_tol = (1e-4, 2e-4, 2e-3)
    if state_dtype != torch.float32:  # one rounding to bf16 (a truncation under the interpreter): one step apart
        state_tol = (8e-3, 1e-2, 1e-2)
    cu = offsets(lens)
    results = []
    for n, (s, i) in enumerate(zip(slots, init)):  # the per-sequence loop, in float64
        sl = slice(cu[n], cu[n + 1])
        s64 = before[s : s + 1].double().clone()
        args = [f64(x[sl]) for x in (q, k, v, g_in, b_in)]
        if gated:
            ref = kda_ref.kda_prefill_gated_ref(*args, f64(A_log), f64(dt_bias), lower_bound, s64, [0, lens[n]],
                                                [0], [i])
        else:
            ref = kda_ref.kda_prefill_ref(*args, s64, [0, lens[n]], [0], [i])
        results += [close(f"o[seq {n}]", out[sl], ref, rel, atol, rtol),
                    close(f"state[seq {n}]", state[s], s64[0].to(state_dtype), *state_tol)]
    untouched = [s for s in range(num_slots) if s not in slots]
    return results + [same("state slots outside the batch", state[untouched], before[untouched])]


def layer_decode_inputs(device: str, B: int, H: int, K: int, state_dtype=torch.float32, dtype=torch.float32,
                        lower_bound=-5.0, seed=0, W=4) -> dict:
    """Arguments of ``kda_layer_decode_launch`` (K = V), two slots more than the batch uses."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C = 3 * H * K

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dt)

    return dict(qkv=rnd(B, C + 7)[:, :C], conv_weight=rnd(C, W, dt=torch.float32, scale=0.5),
                conv_state=rnd(B + 2, C, W - 1), g_raw=rnd(B, H * K), beta_logits=rnd(B, H), gate=rnd(B, H * K),
                A_log=rnd(H, dt=torch.float32, scale=0.3), dt_bias=rnd(H * K, dt=torch.float32),
                lower_bound=lower_bound, norm_weight=rnd(K), eps=1e-5, state=rnd(B + 2, H, K, K, dt=state_dtype),
                state_slots=torch.randperm(B + 2, device=device, generator=gen)[:B])


def layer_decode(device: str, B: int, H: int, K: int, state_dtype=torch.float32, dtype=torch.float32,
                 lower_bound=-5.0, seed=0, W=4) -> list[CheckResult]:
    """``kda_layer_decode_launch`` against the unfused float64 reference: output, state, conv slot (bit for
    bit), and the slots outside the batch."""
    a = layer_decode_inputs(device, B, H, K, state_dtype, dtype, lower_bound, seed, W)
    r = {n: (t.double().clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in a.items()}
    ref = kda_ref.kda_layer_decode_ref(**r)
    conv_before, state_before = a["conv_state"].clone(), a["state"].clone()
    out = torch.full((B, H, K), NAN, dtype=dtype, device=device)
    decode.kda_layer_decode_launch(**a, out=out)
    rel, atol, rtol = tolerances(dtype, device)
    if state_dtype == torch.float32 and dtype == torch.float32:
        state_tol = (1e-6, 1e-5, 1e-4)
    else:  # one bf16 rounding of the new state, or of the conv output that feeds it
        state_tol = (4e-3, 1e-2, 1e-2)
    others = [s for s in range(B + 2) if s not in a["state_slots"].tolist()]
    return [close("o", out, ref, rel, atol, rtol), close("state", a["state"], r["state"], *state_tol),
            same("conv state (the reference's shift)", a["conv_state"].double(), r["conv_state"]),
            same("state slots outside the batch", a["state"][others], state_before[others]),
            same("conv slots outside the batch", a["conv_state"][others], conv_before[others])]


def layer_decode_micro_batches(device: str, B: int, H: int, K: int, state_dtype=torch.float32,
                               dtype=torch.float32) -> list[CheckResult]:
    """The step in the micro-batches of a CUDA graph (forced here, eager; on two streams on CUDA) gives the single
    launch's output and states bit for bit (the same kernels on disjoint rows and slots)."""
    a = layer_decode_inputs(device, B, H, K, state_dtype, dtype)
    got = []
    for micro in (False, True):
        x = {**a, "conv_state": a["conv_state"].clone(), "state": a["state"].clone()}
        out = torch.full((B, H, K), NAN, dtype=dtype, device=device)
        with unittest.mock.patch.object(decode, "in_graph_capture", lambda qkv, micro=micro: micro):
            decode.kda_layer_decode_launch(**x, out=out)
        got.append((out, x["conv_state"], x["state"]))
    return [same(f"micro-batches: {n}", m, s) for n, s, m in zip(("o", "conv_state", "state"), *got)]


def conv_prefill(device: str, lens: list[int], C: int, W: int = 4, dtype=torch.float32, seed=0,
                 **launch) -> list[CheckResult]:
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N = sum(lens), len(lens)
    x = torch.randn(T, C + 5, device=device, generator=gen).to(dtype)[:, :C]  # a column slice, as in the model
    w = torch.randn(C, W, device=device, generator=gen)
    cs = torch.randn(N + 2, C, W - 1, device=device, generator=gen).to(dtype)
    slots = torch.randperm(N + 2, generator=torch.Generator().manual_seed(seed))[:N].tolist()
    init = [bool((i + 1) % 2) for i in range(N)]
    before = cs.clone()
    out = torch.full((T, C), NAN, dtype=dtype, device=device)
    conv.causal_conv1d_prefill_launch(x, w, cs, offsets(lens), slots, init, out=out, **launch)
    cs64 = before.double().clone()
    ref = conv.causal_conv1d_prefill_ref(f64(x), f64(w), cs64, offsets(lens), slots, init)
    rel, atol, rtol = tolerances(dtype, "cpu")
    return [close("y", out, ref, rel, atol, rtol), same("conv state (bit for bit)", cs.double(), cs64)]


def conv_decode(device: str, B: int, C: int, W: int = 4, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, C, device=device, generator=gen).to(dtype)
    w = torch.randn(C, W, device=device, generator=gen)
    cs = torch.randn(B + 2, C, W - 1, device=device, generator=gen).to(dtype)
    slots = torch.randperm(B + 2, device=device, generator=gen)[:B]
    cs64 = cs.double().clone()
    ref = conv.causal_conv1d_decode_ref(f64(x), f64(w), cs64, slots)
    out = torch.full((B, C), NAN, dtype=dtype, device=device)
    conv.causal_conv1d_decode_launch(x, w, cs, slots, out=out)
    rel, atol, rtol = tolerances(dtype, "cpu")
    return [close("y", out, ref, rel, atol, rtol), same("conv state (bit for bit)", cs.double(), cs64)]


def kda_recurrent_f64(q, k, v, g, beta, state):
    """One sequence, token by token, in float64: q/k/v/g [L, H, *], beta [L, H], state [H, K, V]. Independent of
    the chunked reference (ref.py), so both it and the kernels are held to the recurrence itself."""
    K = q.shape[-1]
    q, k = kda_ref.l2norm_ref(q.double()) * K**-0.5, kda_ref.l2norm_ref(k.double())
    v, g, beta, S = v.double(), g.double(), beta.double(), state.double().clone()
    o = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][..., None] * delta[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return o, S


def prefill_recurrence(device: str, dtype=torch.float32, seed=0) -> list[CheckResult]:
    """The public ``kda_prefill`` (kernels on CUDA or under the interpreter, else the chunked reference) against
    the token-by-token float64 recurrence, on a packed batch whose fresh sequences' slots hold NaN."""
    gen = torch.Generator(device=device).manual_seed(seed)
    lens, slots, has_initial = [1, 63, 70], [3, 0, 5], [False, True, True]
    H, K, V, num_slots = 2, 16, 16, 7
    T, cu = sum(lens), offsets(lens)
    q, k, v = (torch.randn(T, H, D, device=device, generator=gen).to(dtype) for D in (K, K, V))
    g = kda_ref.kda_gate_ref(torch.randn(T, H, K, device=device, generator=gen),
                             torch.rand(H, device=device, generator=gen) * 2 - 1,
                             torch.randn(H * K, device=device, generator=gen), lower_bound=-5.0)
    beta = torch.rand(T, H, device=device, generator=gen).sigmoid()
    state = torch.full((num_slots, H, K, V), NAN, device=device)
    for slot, init in zip(slots, has_initial):
        if init:
            state[slot] = torch.randn(H, K, V, device=device, generator=gen) * 0.5
    s0 = state.clone()
    o = prefill.kda_prefill(q, k, v, g, beta, state, cu, slots, has_initial)
    ref_o, ref_s = [], []
    for b, (slot, init) in enumerate(zip(slots, has_initial)):
        start = s0[slot] if init else torch.zeros(H, K, V, device=device)
        sl = slice(cu[b], cu[b + 1])
        ob, sb = kda_recurrent_f64(q[sl], k[sl], v[sl], g[sl], beta[sl], start)
        ref_o.append(ob)
        ref_s.append(sb)
    others = [s for s in range(num_slots) if s not in slots]
    # on CUDA the in-chunk products are tf32 (about 1e-3 relative), a 16-bit output rounds; else float32 throughout
    tol = dict(atol=5e-3, rtol=5e-3) if o.is_cuda else {}
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else tol
    return [compare("o", o, torch.cat(ref_o), **tol), compare("state", state[slots], torch.stack(ref_s), **tol),
            same("slots outside the batch", state[others], s0[others])]


def prefill_checkpoints(device: str, lens: list[int], checkpoints: list[tuple[int, int]], H=2, K=16, V=16,
                        dtype=torch.float32, gated=False, kernels=True, seed=0,
                        state_dtype=torch.float32) -> list[CheckResult]:
    """Prefix checkpoints inside a prefill (checkpoints.py): the states written into the checkpoint slots (poisoned
    with NaN before the run, as is the output) against the token-by-token float64 recurrence over each sequence's
    first ``p`` tokens; the outputs and final states too, and the slots outside the batch untouched. ``checkpoints``
    lists ``(seq, p)``; ``kernels``: the Triton launchers, else the references. ``state_dtype`` bfloat16: every
    slot in bf16, the float64 states rounded to bf16 where the kernels store them (final and checkpoints)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N, T, cu = len(lens), sum(lens), offsets(lens)
    num_slots = N + len(checkpoints) + 2
    slots = list(range(N))
    ckpt_slots = list(range(N, N + len(checkpoints)))
    has_initial = [bool(i % 2) for i in range(N)]
    q, k, v = (torch.randn(T, H, D, device=device, generator=gen).to(dtype) for D in (K, K, V))
    g_raw, b_raw = torch.randn(T, H, K, device=device, generator=gen), torch.randn(T, H, device=device, generator=gen)
    A_log, dt_bias = (torch.rand(H, device=device, generator=gen) * 2 - 1,
                      torch.randn(H * K, device=device, generator=gen))
    g, beta = kda_ref.kda_gate_ref(g_raw, A_log, dt_bias, -5.0), b_raw.sigmoid()
    state = torch.full((num_slots, H, K, V), NAN, device=device, dtype=state_dtype)
    for slot, init in zip(slots, has_initial):
        if init:
            state[slot] = torch.randn(H, K, V, device=device, generator=gen) * 0.5
    s0 = state.clone()
    ckpts = [(n, p, dst) for (n, p), dst in zip(checkpoints, ckpt_slots)]
    seq = (cu, slots, has_initial)
    if kernels:
        out = torch.full((T, H, V), NAN, dtype=dtype, device=device)
        if gated:
            prefill.kda_prefill_gated_launch(q, k, v, g_raw, b_raw, A_log, dt_bias, -5.0, state, *seq, out=out,
                                             checkpoints=ckpts)
        else:
            prefill.kda_prefill_launch(q, k, v, g, beta, state, *seq, out=out, checkpoints=ckpts)
    elif gated:
        out = kda_ref.kda_prefill_gated_ref(q, k, v, g_raw, b_raw, A_log, dt_bias, -5.0, state, *seq, ckpts)
    else:
        out = kda_ref.kda_prefill_ref(q, k, v, g, beta, state, *seq, ckpts)
    # on CUDA the in-chunk products are tf32 (about 1e-3 relative), a 16-bit input rounds; else float32 throughout
    tol = dict(atol=5e-3, rtol=5e-3) if out.is_cuda else {}
    tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else tol
    state_tol = dict(atol=2e-2, rtol=2e-2) if state_dtype != torch.float32 else tol
    results, ref_o, ref_s = [], [], []
    for b, (slot, init) in enumerate(zip(slots, has_initial)):
        start = s0[slot] if init else torch.zeros(H, K, V, device=device)
        sl = slice(cu[b], cu[b + 1])
        ob, sb = kda_recurrent_f64(q[sl], k[sl], v[sl], g[sl], beta[sl], start)
        ref_o.append(ob)
        ref_s.append(sb)
        for n, p, dst in ckpts:
            if n == b:
                rows = slice(cu[b], cu[b] + p)
                _, sp = kda_recurrent_f64(q[rows], k[rows], v[rows], g[rows], beta[rows], start)
                results.append(compare(f"checkpoint state (seq {b}, p {p})", state[dst], sp.to(state_dtype),
                                       **state_tol))
    others = [s for s in range(num_slots) if s not in slots + ckpt_slots]
    return results + [compare("o", out, torch.cat(ref_o), **tol),
                      compare("state", state[slots], torch.stack(ref_s).to(state_dtype), **state_tol),
                      same("slots outside the batch", state[others], s0[others])]


def conv_checkpoints(device: str, lens: list[int], checkpoints: list[tuple[int, int]], C=24, W=4,
                     seed=0) -> list[CheckResult]:
    """``causal_conv1d_save_windows``: each checkpoint slot holds, bit for bit, the conv state that the reference
    conv leaves after the sequence's first ``p`` tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    N, T, cu = len(lens), sum(lens), offsets(lens)
    num_slots = N + len(checkpoints)
    has_initial = [bool(i % 2) for i in range(N)]
    x = torch.randn(T, C, device=device, generator=gen)
    weight = torch.randn(C, W, device=device, generator=gen)
    conv_state = torch.randn(num_slots, C, W - 1, device=device, generator=gen)
    before = conv_state.clone()
    ckpts = [(n, p, N + i) for i, (n, p) in enumerate(checkpoints)]
    conv.causal_conv1d_save_windows(x, conv_state, cu, list(range(N)), has_initial, ckpts)
    results = []
    for n, p, dst in ckpts:
        want = before[n : n + 1].clone()
        conv.causal_conv1d_prefill_ref(x[cu[n] : cu[n] + p], weight, want, [0, p], [0], [has_initial[n]])
        results.append(same(f"conv window (seq {n}, p {p})", conv_state[dst], want[0]))
    return results + [same("sequences' own conv states", conv_state[:N], before[:N])]


def gate(device: str, seed=0) -> list[CheckResult]:
    """``kda_gate_ref`` (whose formula the kernels fuse) against the gate written out in float64."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, H, K = 37, 3, 20
    g_raw = torch.randn(T, H, K, device=device, generator=gen)
    A_log, dt_bias = torch.randn(H, device=device, generator=gen), torch.randn(H * K, device=device, generator=gen)
    g64 = g_raw.double() + dt_bias.double().view(1, H, K)
    rate = A_log.double().exp().view(1, H, 1)
    return [compare("lower_bound", kda_ref.kda_gate_ref(g_raw, A_log, dt_bias, -5.0), -5.0 * torch.sigmoid(rate * g64)),
            compare("softplus", kda_ref.kda_gate_ref(g_raw, A_log, dt_bias, None), -rate * torch.log1p(torch.exp(g64)))]


def _conv_f64(xs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """xs [C, W - 1 + L] (history then inputs), weight [C, W] -> silu(window sums) [L, C] in float64."""
    W, L = weight.shape[1], xs.shape[1] - weight.shape[1] + 1
    y = sum(weight[:, w, None].double() * xs[:, w:w + L].double() for w in range(W))
    return F.silu(y).t()


def conv_window(device: str, seed=0) -> list[CheckResult]:
    """The public conv ops against explicit float64 window sums (independent of conv.py's references): prefill
    over a packed batch whose fresh sequences' slots hold NaN, then one decode step on the same slots."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C, W, num_slots = 37, 4, 6
    lens, slots, has_initial = [2, 1, 41], [5, 1, 3], [True, False, True]
    cu = offsets(lens)
    x = torch.randn(cu[-1], C, device=device, generator=gen)
    weight = torch.randn(C, W, device=device, generator=gen)
    conv_state = torch.full((num_slots, C, W - 1), NAN, device=device)
    for slot, init in zip(slots, has_initial):
        if init:
            conv_state[slot] = torch.randn(C, W - 1, device=device, generator=gen)
    s0 = conv_state.clone()
    out = conv.causal_conv1d_prefill(x, weight, conv_state, cu, slots, has_initial)
    ref, ref_state = [], []
    for b, (slot, init) in enumerate(zip(slots, has_initial)):
        history = s0[slot] if init else torch.zeros(C, W - 1, device=device)
        xs = torch.cat([history.double(), x[cu[b]:cu[b + 1]].t().double()], dim=-1)
        ref.append(_conv_f64(xs, weight))
        ref_state.append(xs[:, -(W - 1):])
    others = [s for s in range(num_slots) if s not in slots]
    results = [compare("prefill", out, torch.cat(ref)),
               compare("prefill_state", conv_state[slots], torch.stack(ref_state)),
               same("prefill_other_slots", conv_state[others], s0[others])]
    xd = torch.randn(len(slots), C, device=device, generator=gen)
    s1 = conv_state.clone()
    out_d = conv.causal_conv1d_decode(xd, weight, conv_state, torch.tensor(slots, device=device))
    xs_d = torch.cat([s1[slots].double(), xd.double()[:, :, None]], dim=-1)  # [B, C, W]
    ref_d = torch.stack([_conv_f64(xs_d[b], weight)[0] for b in range(len(slots))])
    return results + [compare("decode", out_d, ref_d), compare("decode_state", conv_state[slots], xs_d[:, :, 1:]),
                      same("decode_other_slots", conv_state[others], s1[others])]
