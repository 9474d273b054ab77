"""Correctness cases for the KDA and conv kernels, shared by the interpreter run (CPU, small sizes) and
the GPU run (real sizes): each compares a Triton launcher with its reference computed in float64 on fresh
random inputs, with the outputs poisoned (NaN) before the run, state slots outside the batch checked
untouched, and variable-length batches checked against a per-sequence loop."""

from __future__ import annotations

import itertools
import math

import torch

from flashinfra.feedback.registry import compare
from flashinfra.kernels.kda import conv as conv
from flashinfra.kernels.kda import decode as layer
from flashinfra.kernels.kda import prefill as pre
from flashinfra.kernels.kda import ref as kda_ref

NAN = float("nan")


def assert_close(name, out, ref, rel: float, atol: float, rtol: float):
    r = compare(name, out, ref, atol=atol, rtol=rtol)
    assert r.passed and r.rel_norm <= rel, f"{r.summary()} (rel_norm limit {rel:g})"


def tolerances(dtype: torch.dtype, device: str) -> tuple[float, float, float]:
    """(rel_norm, atol, rtol) for an output in ``dtype``: interpreter dots are fp32, GPU in-chunk dots tf32."""
    if dtype in (torch.bfloat16, torch.float16):
        return 8e-3, 2e-2, 2e-2
    return (2e-5, 1e-5, 1e-4) if device == "cpu" else (2e-3, 5e-3, 5e-3)


def offsets(lens):
    return [0] + list(itertools.accumulate(lens))


def f64(t):
    return t.double() if t.is_floating_point() else t


def prefill_varlen(device: str, lens: list[int], H: int, K: int, V: int, dtype=torch.float32, gated=False,
                   lower_bound=-5.0, seed=0, decay=5.0, row_pad=0):
    """``decay`` scales the log-decay (the gate's rate when gated): small values keep a long memory, so that
    products between distant tokens of a chunk matter to the result. ``row_pad``: q, k and v as views of rows
    that many elements longer (a row stride other than H * D)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N = sum(lens), len(lens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device=device, generator=gen).to(dt)

    q, k, v = (rnd(T, H * D + row_pad)[:, :H * D].unflatten(1, (H, D)) for D in (K, K, V))
    num_slots = N + 2
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:N].tolist()
    init = [bool(i % 2) for i in range(N)]
    state = rnd(num_slots, H, K, V, dt=torch.float32)
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
        pre.kda_prefill_gated_launch(q, k, v, g_in, b_in, A_log, dt_bias, lower_bound, state, offsets(lens), slots,
                                     init, out=out)
    else:
        pre.kda_prefill_launch(q, k, v, g_in, b_in, state, offsets(lens), slots, init, out=out)
    rel, atol, rtol = tolerances(dtype, device)
    state_tol = (2e-5, 1e-4, 1e-3) if device == "cpu" else (2e-3, 2e-3, 2e-3)
    if not pre.float32_path(q.dtype, K, V) and device == "cpu":
        # bf16 hi + lo pairs keep about 16 bits (the interpreter rounds to bf16 by truncation)
        state_tol = (1e-4, 2e-4, 2e-3)
    cu = offsets(lens)
    for n, (s, i) in enumerate(zip(slots, init)):  # the per-sequence loop, in float64
        sl = slice(cu[n], cu[n + 1])
        s64 = before[s : s + 1].double().clone()
        args = [f64(x[sl]) for x in (q, k, v, g_in, b_in)]
        if gated:
            ref = kda_ref.kda_prefill_gated_ref(*args, f64(A_log), f64(dt_bias), lower_bound, s64, [0, lens[n]], [0], [i])
        else:
            ref = kda_ref.kda_prefill_ref(*args, s64, [0, lens[n]], [0], [i])
        assert_close(f"o[seq {n}]", out[sl], ref, rel, atol, rtol)
        assert_close(f"state[seq {n}]", state[s], s64[0], *state_tol)
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(state[untouched], before[untouched]), "a state slot outside the batch changed"


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
                 lower_bound=-5.0, seed=0, W=4):
    a = layer_decode_inputs(device, B, H, K, state_dtype, dtype, lower_bound, seed, W)
    r = {n: (t.double().clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in a.items()}
    ref = kda_ref.kda_layer_decode_ref(**r)
    conv_before, state_before = a["conv_state"].clone(), a["state"].clone()
    out = torch.full((B, H, K), NAN, dtype=dtype, device=device)
    layer.kda_layer_decode_launch(**a, out=out)
    rel, atol, rtol = tolerances(dtype, device)
    assert_close("o", out, ref, rel, atol, rtol)
    if state_dtype == torch.float32 and dtype == torch.float32:
        assert_close("state", a["state"], r["state"], 1e-6, 1e-5, 1e-4)
    else:  # one bf16 rounding of the new state, or of the conv output that feeds it
        assert_close("state", a["state"], r["state"], 4e-3, 1e-2, 1e-2)
    assert torch.equal(a["conv_state"].double(), r["conv_state"]), "conv state differs from the reference shift"
    others = [s for s in range(B + 2) if s not in a["state_slots"].tolist()]
    assert torch.equal(a["state"][others], state_before[others]) and torch.equal(a["conv_state"][others],
                                                                                  conv_before[others])


def conv_prefill(device: str, lens: list[int], C: int, W: int = 4, dtype=torch.float32, seed=0, **launch):
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
    assert_close("y", out, ref, rel, atol, rtol)
    assert torch.equal(cs.double(), cs64), "conv state must match the reference bit for bit"


def conv_decode(device: str, B: int, C: int, W: int = 4, dtype=torch.float32, seed=0):
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
    assert_close("y", out, ref, rel, atol, rtol)
    assert torch.equal(cs.double(), cs64), "conv state must match the reference bit for bit"


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` then decode ``steps`` tokens greedily, one sequence, through the model's forward."""
    from flashinfra.model.forward_batch import ForwardBatch

    bs, dev = 16, model.device
    table = list(range((len(prompt) + steps + bs - 1) // bs))
    cache = model.allocate_cache(len(table), bs, 2)
    batch = ForwardBatch.build([len(prompt)], [0], [1], [table], bs, dev)
    hidden = model.forward(torch.tensor(prompt, device=dev), batch, cache)
    logits = [model.compute_logits(hidden[-1:])[0]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        batch = ForwardBatch.build([1], [len(prompt) + i], [1], [table], bs, dev)
        hidden = model.forward(torch.tensor(tokens[-1:], device=dev), batch, cache)
        logits.append(model.compute_logits(hidden)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def tiny_model_greedy_same(tmp_path, monkeypatch, device: str, steps: int = 8):
    """The tiny model's greedy tokens (prefill + decode) are the same with the KDA/conv kernels and with their
    references. Every other op runs its reference in both runs, so only these kernels are compared."""
    from flashinfra.kernels import dispatch
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    mine = (conv, layer, pre)
    calls = {}
    for mod in mine:
        for name in [n for n in vars(mod) if n.endswith("_launch")]:
            def counted(*args, _f=getattr(mod, name), _n=name, **kwargs):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*args, **kwargs)

            monkeypatch.setattr(mod, name, counted)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=1), dtype="float32", device=device)
    prompt = torch.randint(1, model.config.text.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    for mod in mine:
        monkeypatch.setattr(mod, "use_triton", lambda *tensors: True)
    fast, fast_logits = greedy(model, prompt, steps)
    for name in ("kda_prefill_gated_launch", "kda_layer_decode_launch", "causal_conv1d_prefill_launch"):
        assert calls.get(name, 0) > 0, f"{name} never ran: {calls}"
    for mod in mine:
        monkeypatch.setattr(mod, "use_triton", lambda *tensors: False)
    ref, ref_logits = greedy(model, prompt, steps)
    assert fast == ref
    for a, b in zip(fast_logits, ref_logits):
        assert float((a - b).norm() / b.norm()) < 1e-2
