"""Correctness cases of the kernels that form new tokens' cache rows and store them at their slots in one launch:
the MLA latent's norm (``norms.rms_norm_to_slots_launch``) and the DSA indexer's entries
(``dsa_entries.write_entries_launch``). As ``check_cases``' cases: fresh random inputs, caches poisoned first,
results against float64 references; every row but the slots' must stay as it was, a negative slot writes nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashinfra.feedback.registry import CheckResult, compare, poison_
from flashinfra.kernels import norms as nm
from flashinfra.kernels.check_cases import _d, _gen, _verdict, rnd, tol
from flashinfra.kernels.dsa_entries import write_entries_launch


def _slots(T: int, S: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """``T`` distinct slots of ``S`` rows, one of them negative, and the mask of the rows no slot names."""
    slots = torch.randperm(S, device=device, generator=gen)[:T]
    slots[T // 2] = -1
    untouched = torch.ones(S, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    return slots, untouched


def cache_writes(device: str, T: int, D: int, Di: int, dtype=torch.float32, seed=0) -> list[CheckResult]:
    gen = _gen(device, seed)
    x, w = rnd(T, D, device=device, gen=gen, dtype=dtype), rnd(D, device=device, gen=gen, dtype=dtype)
    cache = poison_(torch.empty(2 * T + 3, D, dtype=dtype, device=device))
    slots, untouched = _slots(T, 2 * T + 3, device, gen)
    y = nm.rms_norm_to_slots_launch(x, w, 1e-5, cache, slots)
    kept = slots >= 0
    res = [_verdict("hotpath.cache_writes.latent_rows", torch.equal(y, nm.rms_norm_launch(x, w, 1e-5)),
                    "the rows rms_norm gives"),
           _verdict("hotpath.cache_writes.latent_at_slots", torch.equal(cache[slots[kept]], y[kept]),
                    "the rows at their slots"),
           _verdict("hotpath.cache_writes.latent_others", bool(cache[untouched].isnan().all()), "no other row written")]
    kg = rnd(T, 2 * Di + 5, device=device, gen=gen, dtype=dtype)[:, : 2 * Di]  # the projection's columns, strided
    lw, lb = 1 + rnd(Di, device=device, gen=gen, dtype=dtype, scale=0.3), rnd(Di, device=device, gen=gen, dtype=dtype)
    rows = poison_(torch.empty(2 * T + 3, 2 * Di, dtype=dtype, device=device))
    slots, untouched = _slots(T, 2 * T + 3, device, gen)
    write_entries_launch(kg, lw, lb, 1e-6, rows, slots)
    kept = slots >= 0
    ref = torch.cat([F.layer_norm(_d(kg[:, :Di]), (Di,), _d(lw), _d(lb), eps=1e-6), _d(kg[:, Di:])], dim=-1)
    return res + [compare("hotpath.cache_writes.entries", rows[slots[kept]], ref[kept], **tol(dtype)),
                  _verdict("hotpath.cache_writes.entries_others", bool(rows[untouched].isnan().all()),
                           "no other row written")]
