"""Correctness cases of the mHC kernels (``mhc.py``): the collapse with its weights, the expand, the collapse with the
block's input norm, and the expand forming the next hyper-connection's mix product; as ``check_cases``' cases, against
float64 references, shared by the registered check (``checks.py``) and the tests (the interpreter's and the GPU's)."""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult, compare
from flashinfra.kernels import mhc as hc, mhc_expand as ex, norms as nm
from flashinfra.kernels.check_cases import _d, _gen, _verdict, rnd, tol


def mhc(device: str, T: int, D: int, n: int = 4, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    streams = rnd(T, n, D, device=device, gen=gen, dtype=dtype)
    fn = rnd((2 + n) * n, n * D, device=device, gen=gen, dtype=dtype, scale=(n * D) ** -0.5)
    base = rnd((2 + n) * n, device=device, gen=gen, scale=0.3)
    scale = 1 + rnd(3, device=device, gen=gen, scale=0.3)
    y, post, comb = hc.hc_pre_launch(streams, fn, base, scale, n, 20, 1e-6, 1e-5)
    ry, rpost, rcomb = hc.hc_pre_ref(_d(streams), _d(fn), _d(base), _d(scale), n, 20, 1e-6, 1e-5)
    wtol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    out = rnd(T, D, device=device, gen=gen, dtype=dtype)
    new = ex.hc_post_launch(streams, out, post, comb)
    return [compare("hotpath.mhc.post_weights", post, rpost, **wtol),
            compare("hotpath.mhc.comb", comb, rcomb, **wtol),
            compare("hotpath.mhc.collapsed", y, ry, **tol(dtype)),
            compare("hotpath.mhc.expand", new, ex.hc_post_ref(_d(streams), _d(out), rpost, rcomb), **tol(dtype)),
            *_mhc_norm(streams, fn, base, scale, n, gen, ry, rpost, rcomb, wtol),
            *_post_mix(streams, out, post, comb, n, gen, rpost, rcomb, wtol), *_collapse_norm(streams, gen),
            _embed(streams, gen)]


def _mhc_norm(streams, fn, base, scale, n, gen, ry, rpost, rcomb, wtol) -> list[CheckResult]:
    """``hc_pre_norm``: the collapse with the block's input norm (plain rows; int8 codes with and without the normed
    rows) against the float64 collapse then norm, and its codes against the activation quantizer's of its own normed
    rows on the same device (the GPU may contract the codes' rounding into an FMA, which a float reference does not)."""
    from flashinfra.kernels.quant.act import quant_int8_per_token

    dtype, D = streams.dtype, streams.shape[2]
    w = 1 + rnd(D, device=streams.device, gen=gen, dtype=dtype, scale=0.3)
    rn = nm.rms_norm_ref(ry, _d(w), 1e-5)
    y, q, s, post, comb = hc.hc_pre_norm(streams, fn, base, scale, n, 20, 1e-6, 1e-5, w, 1e-5, False, False)
    res = [compare("hotpath.mhc_norm.normed", y, rn, **tol(dtype)),
           compare("hotpath.mhc_norm.comb", comb, rcomb, **wtol),
           compare("hotpath.mhc_norm.post_weights", post, rpost, **wtol)]
    for keep in (True, False):
        y, q, s, _, _ = hc.hc_pre_norm(streams, fn, base, scale, n, 20, 1e-6, 1e-5, w, 1e-5, True, keep)
        step = s.double()[:, None]  # one code's width: the int8 rounding's error is at most half of it
        res.append(compare(f"hotpath.mhc_norm.codes_keep{int(keep)}", q.double() * step, rn,
                           atol=float(step.max()) / 2 + tol(dtype)["atol"], rtol=tol(dtype)["rtol"]))
        if keep:
            rq, rs = quant_int8_per_token(y)
            res.append(_verdict("hotpath.mhc_norm.codes_of_its_rows", torch.equal(q, rq) and torch.equal(s, rs),
                                "the codes are the activation quantizer's of the normed rows it returns"))
        else:
            res.append(_verdict("hotpath.mhc_norm.no_rows", y is None, "no normed rows unless kept"))
    return res


def _post_mix(streams, out, post, comb, n, gen, rpost, rcomb, wtol) -> list[CheckResult]:
    """The expand given the next hyper-connection's projection: the new streams against float64; where it forms their
    mix product (``post_mix``), the next collapse from it against float64's collapse of those streams."""
    dtype, dev, (T, _, D) = streams.dtype, streams.device, streams.shape
    fn = rnd((2 + n) * n, n * D, device=dev, gen=gen, dtype=dtype, scale=(n * D) ** -0.5)
    base, scale = rnd((2 + n) * n, device=dev, gen=gen, scale=0.3), 1 + rnd(3, device=dev, gen=gen, scale=0.3)
    new = ex.hc_post_launch(streams, out, post, comb, fn)
    formed = getattr(new, "hc_mixed", None) is not None
    y, npost, ncomb = hc.hc_pre_launch(new, fn, base, scale, n, 20, 1e-6, 1e-5)
    ry, rpost2, rcomb2 = hc.hc_pre_ref(_d(new), _d(fn), _d(base), _d(scale), n, 20, 1e-6, 1e-5)
    return [compare("hotpath.mhc_post_mix.expand", new, ex.hc_post_ref(_d(streams), _d(out), rpost, rcomb),
                    **tol(dtype)),
            _verdict("hotpath.mhc_post_mix.formed", formed == ex.post_mix(T, fn),
                     f"the expand formed the next mix product: {formed}, expected {ex.post_mix(T, fn)}"),
            compare("hotpath.mhc_post_mix.collapsed", y, ry, **tol(dtype)),
            compare("hotpath.mhc_post_mix.post_weights", npost, rpost2, **wtol),
            compare("hotpath.mhc_post_mix.comb", ncomb, rcomb2, **wtol)]


def _collapse_norm(streams, gen) -> list[CheckResult]:
    """The final hidden states (``hc_collapse_norm``) against float64's norm of the streams' mean, and the same bits as
    deterministic mode's mean (a sum in stream order) then the norm kernel."""
    from flashinfra.kernels.dispatch import deterministic

    dtype, D = streams.dtype, streams.shape[2]
    w = 1 + rnd(D, device=streams.device, gen=gen, dtype=dtype, scale=0.3)
    y = hc.hc_collapse_norm_launch(streams, w, 1e-5)
    with deterministic(True):
        two = nm.rms_norm_launch(hc.hc_collapse(streams), w, 1e-5)
    return [compare("hotpath.mhc_final.normed", y, nm.rms_norm_ref(_d(streams).mean(1), _d(w), 1e-5), **tol(dtype)),
            _verdict("hotpath.mhc_final.as_two_ops", torch.equal(y, two),
                     "the same bits as the stream-order mean, then the norm")]


def _embed(streams, gen) -> CheckResult:
    """The first layer's streams (``hc_embed``): each token's embedding row in every stream, exactly."""
    (T, n, D), dev = streams.shape, streams.device
    table = rnd(3 * T + 5, D, device=dev, gen=gen, dtype=streams.dtype)
    ids = torch.randint(0, 3 * T + 5, (T,), device=dev, generator=gen)
    got = hc.hc_embed(ids, table, n)
    return _verdict("hotpath.mhc_embed.streams", torch.equal(got, table[ids][:, None, :].expand(T, n, D)),
                    "every stream the token's embedding row")
