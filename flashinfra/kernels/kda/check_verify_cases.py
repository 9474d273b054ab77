"""Correctness cases of the ReplaySSM verify and fold kernels (verify.py, fold.py), shared by the registered check
(checks.py) and the tests: outputs and ring entries poisoned (NaN) before the run and compared with the reference
verify in float64; the checkpoint untouched; ring entries past each run untouched; the outputs bit for bit those of
the decode kernel stepped token by token; the fold kernel of an accepted prefix bit for bit the decode kernel
stepped over it (state and conv window), within rounding of the reference decode and of the reference fold, other
slots untouched.
"""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult
from flashinfra.kernels.kda import decode
from flashinfra.kernels.kda import ref as kda_ref
from flashinfra.kernels.kda.check_cases import NAN, close, f64, offsets, same, tolerances
from flashinfra.kernels.kda.verify import kda_layer_verify_launch
from flashinfra.kernels.kda.fold import kda_fold_launch
from flashinfra.model.replay import ReplayRing, kda_fold_ref, kda_layer_verify_ref

PARAMS = ("conv_weight", "g_raw", "beta_logits", "gate", "A_log", "dt_bias", "lower_bound", "norm_weight", "eps")


def verify_inputs(device: str, lens: list[int], H: int, K: int, state_dtype=torch.float32, dtype=torch.float32,
                  lower_bound=-5.0, seed=0, W=4) -> dict:
    """Arguments of ``kda_layer_verify_launch`` (K = V) without the ring: len(lens) sequences in random slots of
    len(lens) + 2, the q|k|v rows 7 elements longer than their channels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, B, C = sum(lens), len(lens), 3 * H * K

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dt)

    return dict(qkv=rnd(T, C + 7)[:, :C], conv_weight=rnd(C, W, dt=torch.float32, scale=0.5),
                conv_state=rnd(B + 2, C, W - 1), g_raw=rnd(T, H * K), beta_logits=rnd(T, H), gate=rnd(T, H * K),
                A_log=rnd(H, dt=torch.float32, scale=0.3), dt_bias=rnd(H * K, dt=torch.float32),
                lower_bound=lower_bound, norm_weight=rnd(K), eps=1e-5,
                state=rnd(B + 2, H, K, K, dt=state_dtype, scale=0.3),
                state_slots=torch.randperm(B + 2, device=device, generator=gen)[:B])


def poisoned_ring(num_slots: int, R: int, H: int, K: int, dtype, device) -> ReplayRing:
    ring = ReplayRing.allocate(num_slots, R, H, K, K, dtype, device)
    for t in (ring.x, ring.k, ring.v, ring.g, ring.beta):
        t.fill_(NAN)
    return ring


def _decode_steps(a: dict, rows: range, slot: int, conv_state, state) -> torch.Tensor:
    """The decode kernel on ``rows`` one token at a time (slot ``slot`` of the given conv and state tensors)."""
    slots = torch.tensor([slot], device=state.device)
    outs = [decode.kda_layer_decode_launch(a["qkv"][t : t + 1], a["conv_weight"], conv_state, a["g_raw"][t : t + 1],
                                           a["beta_logits"][t : t + 1], a["gate"][t : t + 1], a["A_log"],
                                           a["dt_bias"], a["lower_bound"], a["norm_weight"], a["eps"], state, slots)
            for t in rows]
    return torch.cat(outs) if outs else a["qkv"].new_empty(0, *state.shape[1:3])


def _decode_ref_steps(a: dict, rows: range, slot: int, conv_state, state) -> None:
    """The reference decode on ``rows`` one token at a time."""
    slots = torch.tensor([slot], device=state.device)
    for t in rows:
        kda_ref.kda_layer_decode_ref(a["qkv"][t : t + 1], a["conv_weight"], conv_state, a["g_raw"][t : t + 1],
                                     a["beta_logits"][t : t + 1], a["gate"][t : t + 1], a["A_log"], a["dt_bias"],
                                     a["lower_bound"], a["norm_weight"], a["eps"], state, slots)


def layer_verify(device: str, lens: list[int], H: int, K: int, state_dtype=torch.float32, dtype=torch.float32,
                 lower_bound=-5.0, seed=0, W=4) -> list[CheckResult]:
    a = verify_inputs(device, lens, H, K, state_dtype, dtype, lower_bound, seed, W)
    cu, slots = offsets(lens), a["state_slots"].tolist()
    S, R, T = len(lens) + 2, max(lens) + 1, sum(lens)
    ring = poisoned_ring(S, R, H, K, dtype, device)
    conv0, state0 = a["conv_state"].clone(), a["state"].clone()
    out = torch.full((T, H, K), NAN, dtype=dtype, device=device)
    kda_layer_verify_launch(**{**a, "state_slots": a["state_slots"].int()}, ring=ring,
                            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device), out=out)

    r = {n: f64(t) for n, t in a.items()}
    ring64 = ReplayRing.allocate(S, R, H, K, K, torch.float64, device)
    ring64.g, ring64.beta = ring64.g.double(), ring64.beta.double()
    ref = kda_layer_verify_ref(*(r[n] for n in ("qkv",) + PARAMS[:1]), r["conv_state"],
                               *(r[n] for n in PARAMS[1:]), r["state"], ring64, slots, cu)
    # a bf16 state rounds each step (the float64 reference's does not), which later tokens' outputs see
    rel, atol, rtol = tolerances(dtype if state_dtype == torch.float32 else state_dtype, device)
    written = torch.zeros(S, R, dtype=torch.bool, device=device)
    for b, s in enumerate(slots):
        written[s, : lens[b]] = True
    results = [close("o", out, ref, rel, atol, rtol),
               same("checkpoint state read only", a["state"], state0),
               same("checkpoint conv window read only", a["conv_state"], conv0),
               same("ring x (a copy of q|k|v)", ring.x[written].double(), ring64.x[written]),
               same("ring entries past each run untouched", ring.g[~written], torch.full_like(ring.g[~written], NAN))]
    results += [close(f"ring {n}", getattr(ring, n)[written], getattr(ring64, n)[written], rel, atol, rtol)
                for n in ("k", "v", "g", "beta")]

    decoded, by_kernel, by_ref, conv_ok = [], [], [], []
    accepted = [(n + 1) // 2 for n in lens]
    kda_fold_launch(ring, a["conv_state"], a["state"], a["state_slots"].int(),
                    torch.tensor(accepted, dtype=torch.int32, device=device))
    for b, s in enumerate(slots):
        conv, state = conv0.clone(), state0.clone()
        decoded.append(_decode_steps(a, range(cu[b], cu[b + 1]), s, conv, state))
        conv, state = conv0.clone(), state0.clone()
        _decode_steps(a, range(cu[b], cu[b] + accepted[b]), s, conv, state)
        by_kernel.append((a["state"][s], state[s]))
        conv_ok.append((a["conv_state"][s], conv[s]))
        conv, state = conv0.clone(), state0.clone()
        _decode_ref_steps(a, range(cu[b], cu[b] + accepted[b]), s, conv, state)
        by_ref.append((a["state"][s], state[s]))
    untouched = [s for s in range(S) if s not in slots]
    cat = torch.cat
    results.append(same("o == the decode kernel stepped token by token", out, cat(decoded)))
    results.append(same("fold: conv window == sequential decode", cat([x for x, _ in conv_ok]),
                        cat([y for _, y in conv_ok])))
    results.append(same("fold: state == the decode kernel stepped token by token", cat([x for x, _ in by_kernel]),
                        cat([y for _, y in by_kernel])))
    results.append(same("fold: other slots untouched", a["state"][untouched], state0[untouched]))
    # a bf16 state rounds each step, where the kernel's and the reference's sums may land one unit apart (2^-8
    # relative); a half-precision conv output likewise
    state_tol = ((1e-6, 1e-5, 1e-4) if state_dtype == dtype == torch.float32 else
                 (1e-2, 1e-2, 1e-2) if dtype == torch.float32 else tolerances(dtype, device))
    results.append(close("fold: state == sequential reference decode", cat([x for x, _ in by_ref]).double(),
                         cat([y for _, y in by_ref]).double(), *state_tol))
    ring_state, ring_conv = state0.clone(), conv0.clone()
    kda_fold_ref(ring, ring_conv, ring_state, slots, accepted)
    results.append(close("fold kernel == reference fold", a["state"].double(), ring_state.double(), *state_tol))
    results.append(same("fold kernel's conv window == reference fold's", a["conv_state"], ring_conv))
    return results
