"""The check and benchmark registries: the contract every kernel, model, scheduler and server module
codes against to give feedback.

A **check** compares a fast path with its float64 reference on fresh random inputs and returns
``CheckResult`` figures (max abs error, relative norm, the worst element and where the wrong elements
are), not only pass/fail::

    from flashinfra.feedback.registry import register_check, register_benchmark, compare, CheckResult

    @register_check("kda.decode", tags=("kernel",))
    def check_kda_decode():                      # -> CheckResult | list[CheckResult]
        out = torch.full_like(ref, float("nan")) # poison outputs before the run
        ...
        return compare("kda.decode.o", out, ref64, dtype=torch.bfloat16)

A **benchmark** returns a ``BenchSpec``; the runner (``flashinfra.feedback.bench``) times
``spec.fn(*spec.make_inputs(seed))`` with warm-up, fresh inputs each run, an L2 flush on the GPU, reports
median and spread and the fraction of the measured ceilings, re-checks outputs with ``spec.check`` and
flags outputs that stay identical across different inputs (a cached result)::

    @register_benchmark("kda.decode.b64", tags=("kernel", "gpu"))
    def bench_kda_decode(ctx: BenchContext) -> BenchSpec:
        return BenchSpec(fn=kda_decode, make_inputs=lambda seed: (...), bytes=..., flops=...,
                         check=lambda inputs, out: compare(...))

Convention: each package registers its checks and benchmarks in its own ``checks.py`` (``kernels``,
``kernels.kda``, ``model``, ``engine``, ``engine.sched``, ``server``; ``feedback.checks`` holds the feedback
package's own), so the one name says "this package's feedback" wherever it appears. A check module keeps
its cases as functions of (device, sizes, dtype, seed) returning ``list[CheckResult]``: the registered
checks call them at fixed sizes and the tests call them at their own, through ``assert_passed(results)``.

Discovery: ``load_providers()`` imports every module in ``PROVIDERS`` so that they register. A provider
that does not exist or fails to import is returned with its traceback, so the caller reports it: a renamed
module never silently takes its checks away.

This module owns the data types, ``compare``, the registries and discovery. Running checks lives in
``flashinfra.feedback.check``, timing in ``flashinfra.feedback.bench``. It imports torch only inside
``compare`` so that torch-free packages (the scheduler) can register checks cheaply.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

PROVIDERS: tuple[str, ...] = (
    "flashinfra.feedback.checks",
    "flashinfra.kernels.kda.checks",
    "flashinfra.kernels.checks",
    "flashinfra.kernels.dsa_indexer_cases",
    "flashinfra.kernels.dsa_benches",
    "flashinfra.kernels.vision_cases",
    "flashinfra.kernels.quant.checks",
    "flashinfra.model.checks",
    "flashinfra.engine.checks",
    "flashinfra.engine.sched.checks",
    "flashinfra.server.checks",
)

# (atol, rtol) of a fast path in this dtype against a float64 reference; an element passes when
# |out - ref| <= atol + rtol * |ref| (numpy.isclose's rule). bf16 keeps 8 mantissa bits (eps 2^-8),
# fp16 11 bits, fp32 24 bits; the margins allow accumulation over a few hundred terms.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-9),
    "float32": (1e-5, 1e-4),
    "tfloat32": (1e-3, 1e-3),
    "float16": (1e-3, 2e-3),
    "bfloat16": (1e-2, 1.6e-2),
    "float8_e4m3fn": (6e-2, 1.25e-1),
    "float8_e5m2": (1.25e-1, 2.5e-1),
    "int8": (0.0, 0.0),
    "int32": (0.0, 0.0),
    "int64": (0.0, 0.0),
    "bool": (0.0, 0.0),
}

MAX_REPORTED_ELEMENTS = 8


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def tolerances(dtype: Any) -> tuple[float, float]:
    """Default (atol, rtol) for outputs computed in ``dtype``."""
    name = dtype_name(dtype)
    if name not in DEFAULT_TOLERANCES:
        raise ValueError(f"no default tolerance for dtype {name!r}; pass atol and rtol explicitly")
    return DEFAULT_TOLERANCES[name]


@dataclass
class CheckResult:
    """Error figures of one output against its reference. ``passed`` is False for any non-finite output."""

    name: str
    passed: bool
    max_abs: float = 0.0
    rel_norm: float = 0.0
    worst_index: tuple[int, ...] | None = None
    worst_out: float | None = None
    worst_ref: float | None = None
    num_nonfinite: int = 0
    num_bad: int = 0  # elements outside atol + rtol * |ref|, non-finite ones included
    numel: int = 0
    bad_indices: list[tuple[int, ...]] = field(default_factory=list)  # the first few, in index order
    bad_extent: list[tuple[int, int]] | None = None  # per dim: (min, max) index over the bad elements
    shape: tuple[int, ...] = ()
    dtype: str = ""
    atol: float = 0.0
    rtol: float = 0.0
    message: str = ""
    seconds: float | None = None  # filled in by the check runner

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # Strict JSON has no NaN/inf: such figures become the strings "nan", "inf", "-inf".
        for key, value in d.items():
            if isinstance(value, float) and not math.isfinite(value):
                d[key] = str(value)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CheckResult":
        """The inverse of ``to_dict`` (JSON lists back to tuples, "nan"/"inf" strings back to floats)."""
        d = dict(d)
        for key in ("max_abs", "rel_norm", "worst_out", "worst_ref", "atol", "rtol"):
            if isinstance(d.get(key), str):
                d[key] = float(d[key])
        for key in ("worst_index", "shape"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        d["bad_indices"] = [tuple(i) for i in d.get("bad_indices", [])]
        if d.get("bad_extent") is not None:
            d["bad_extent"] = [tuple(i) for i in d["bad_extent"]]
        return cls(**d)

    def summary(self) -> str:
        """One line: verdict, figures and where the wrong elements are."""
        verdict = "PASS" if self.passed else "FAIL"
        if self.numel == 0 and self.message:
            return f"{verdict} {self.name}: {self.message}"
        text = (
            f"{verdict} {self.name}: max_abs={self.max_abs:.3g} rel_norm={self.rel_norm:.3g} "
            f"[{self.dtype} atol={self.atol:g} rtol={self.rtol:g}] shape={list(self.shape)}"
        )
        if self.worst_index is not None:
            text += f" worst{list(self.worst_index)}: out={self.worst_out:.6g} ref={self.worst_ref:.6g}"
        if self.num_bad:
            text += f"; {self.num_bad}/{self.numel} bad"
            if self.num_nonfinite:
                text += f" ({self.num_nonfinite} non-finite)"
            text += f" at {[list(i) for i in self.bad_indices]}"
            if self.num_bad > len(self.bad_indices):
                text += " ..."
            if self.bad_extent is not None:
                text += " extent " + " x ".join(f"{lo}..{hi}" for lo, hi in self.bad_extent)
        if self.message:
            text += f"; {self.message}"
        return text


def failed(name: str, message: str) -> CheckResult:
    """A result for a check that could not compare anything (exception, shape mismatch...)."""
    return CheckResult(name=name, passed=False, message=message)


def assert_passed(results: list[CheckResult]) -> None:
    """For tests: raise ``AssertionError`` listing every failing result's summary (or saying that
    ``results`` is empty: a case that checked nothing proves nothing)."""
    if not results:
        raise AssertionError("no check results")
    bad = [r.summary() for r in results if not r.passed]
    if bad:
        raise AssertionError(f"{len(bad)} of {len(results)} results failed:\n" + "\n".join(bad))


def compare(name: str, out: Any, ref: Any, dtype: Any = None, atol: float | None = None,
            rtol: float | None = None) -> CheckResult:
    """Compare ``out`` with ``ref`` (ideally computed in float64); tolerances default by ``dtype``
    (``out.dtype`` when None). A NaN or inf in ``out`` never passes; nor does a shape mismatch."""
    import torch

    out_t, ref_t = torch.as_tensor(out), torch.as_tensor(ref)
    name_dtype = dtype_name(dtype if dtype is not None else out_t.dtype)
    d_atol, d_rtol = tolerances(name_dtype) if atol is None or rtol is None else (0.0, 0.0)
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)
    shape = tuple(out_t.shape)
    if tuple(out_t.shape) != tuple(ref_t.shape):
        r = failed(name, f"shape mismatch: out {list(out_t.shape)} vs ref {list(ref_t.shape)}")
        r.shape, r.dtype, r.atol, r.rtol = shape, name_dtype, atol, rtol
        return r
    o = out_t.detach().to("cpu", torch.float64)
    r64 = ref_t.detach().to("cpu", torch.float64)
    result = CheckResult(name=name, passed=True, shape=shape, dtype=name_dtype, atol=atol, rtol=rtol,
                         numel=o.numel())
    if o.numel() == 0:
        return result
    nonfinite_ref = ~torch.isfinite(r64)
    if nonfinite_ref.any():
        result.passed = False
        result.message = f"reference has {int(nonfinite_ref.sum())} non-finite elements"
    nonfinite = ~torch.isfinite(o)
    result.num_nonfinite = int(nonfinite.sum())
    diff = (o - r64).abs()
    # A non-finite output element is the worst possible one: rank it first.
    ranked = torch.where(nonfinite, torch.full_like(diff, math.inf), diff)
    ranked = torch.nan_to_num(ranked, nan=math.inf)
    bad = nonfinite | ~(diff <= atol + rtol * r64.abs())
    result.num_bad = int(bad.sum())
    finite_diff = diff[~nonfinite & ~nonfinite_ref]
    result.max_abs = math.inf if result.num_nonfinite else float(finite_diff.max()) if finite_diff.numel() else 0.0
    ref_norm = float(torch.linalg.vector_norm(r64[~nonfinite_ref])) if (~nonfinite_ref).any() else 0.0
    diff_norm = math.inf if result.num_nonfinite else float(torch.linalg.vector_norm(finite_diff))
    result.rel_norm = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    flat = int(torch.argmax(ranked.reshape(-1)))
    worst = _unravel(flat, shape)
    result.worst_index = worst
    result.worst_out = float(o.reshape(-1)[flat])
    result.worst_ref = float(r64.reshape(-1)[flat])
    if result.num_bad:
        result.passed = False
        where = torch.nonzero(bad.reshape(shape) if shape else bad.reshape(1))
        result.bad_indices = [tuple(int(x) for x in row) for row in where[:MAX_REPORTED_ELEMENTS]]
        if where.shape[1]:
            lo, hi = where.min(0).values, where.max(0).values
            result.bad_extent = [(int(a), int(b)) for a, b in zip(lo, hi)]
    return result


def poison_(tensor):
    """Fill ``tensor`` in place with values no correct kernel writes (NaN for floats, the dtype's
    minimum for integers), so an output element the fast path forgets to write cannot pass."""
    import torch

    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.fill_(float("nan"))
    if tensor.dtype == torch.bool:
        raise ValueError("a bool tensor cannot be poisoned; compare a non-bool view of it")
    return tensor.fill_(torch.iinfo(tensor.dtype).min)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


@dataclass(frozen=True)
class BenchContext:
    """What a benchmark factory may adapt to: the device, the dtype, and ``quick`` (small sizes for CI)."""

    device: str = "cpu"
    dtype: str = "bfloat16"
    quick: bool = False

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


@dataclass
class BenchSpec:
    """One timed op. ``make_inputs(seed)`` returns the argument tuple for ``fn``; different seeds must give
    different inputs. ``bytes`` and ``flops`` are per call of ``fn``, for the roofline fractions."""

    fn: Callable[..., Any]
    make_inputs: Callable[[int], Any]
    bytes: int = 0
    flops: int = 0
    check: Callable[[Any, Any], CheckResult | list[CheckResult]] | None = None
    description: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    tags: tuple[str, ...]
    module: str


_CHECKS: dict[str, Entry] = {}
_BENCHMARKS: dict[str, Entry] = {}


def _register(table: dict[str, Entry], kind: str, name: str, tags: tuple[str, ...]):
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"{kind} name must be non-empty without spaces, got {name!r}")

    def decorator(fn):
        entry = Entry(name=name, fn=fn, tags=tuple(tags), module=fn.__module__)
        old = table.get(name)
        # Re-importing the same module re-registers the same function: allowed. Two modules: a clash.
        if old is not None and (old.module, old.fn.__qualname__) != (entry.module, fn.__qualname__):
            raise ValueError(f"{kind} {name!r} already registered by {old.module}.{old.fn.__qualname__}")
        table[name] = entry
        return fn

    return decorator


def register_check(name: str, tags: tuple[str, ...] = ()):
    """Decorator: ``fn() -> CheckResult | list[CheckResult]`` registered as check ``name``."""
    return _register(_CHECKS, "check", name, tags)


def register_benchmark(name: str, tags: tuple[str, ...] = ()):
    """Decorator: ``fn(ctx: BenchContext) -> BenchSpec`` registered as benchmark ``name``."""
    return _register(_BENCHMARKS, "benchmark", name, tags)


def checks() -> dict[str, Entry]:
    return dict(sorted(_CHECKS.items()))


def benchmarks() -> dict[str, Entry]:
    return dict(sorted(_BENCHMARKS.items()))


def select(table: dict[str, Entry], patterns: list[str] | None) -> list[Entry]:
    """Entries whose name equals a pattern, starts with ``pattern + "."``, matches it as a glob, or
    carries it as a tag. No patterns: all entries. A pattern that matches nothing is an error."""
    import fnmatch

    if not patterns:
        return list(table.values())
    chosen: dict[str, Entry] = {}
    for pattern in patterns:
        hits = [e for n, e in table.items()
                if n == pattern or n.startswith(pattern + ".") or fnmatch.fnmatchcase(n, pattern)
                or pattern in e.tags]
        if not hits:
            raise KeyError(f"nothing registered matches {pattern!r}; known: {', '.join(table) or '(none)'}")
        chosen.update((e.name, e) for e in hits)
    return [chosen[n] for n in sorted(chosen)]


def load_providers(providers: tuple[str, ...] = PROVIDERS) -> list[tuple[str, str]]:
    """Import each provider so it registers. Returns ``(module, traceback)`` for every provider that is
    absent or failed to import."""
    errors = []
    for module in providers:
        try:
            importlib.import_module(module)
        except Exception:
            errors.append((module, traceback.format_exc()))
    return errors
