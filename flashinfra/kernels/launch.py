"""Triton launches with less host work per call, for the ops that run eagerly (prefill).

``kernel[grid](*args, **kw)`` binds the arguments in Python, builds the specialisation key as a string, checks
the kernel's globals and reads Triton's settings on every call: host time that can exceed the GPU time of a short
prefill's kernels. ``fast(kernel)`` wraps a ``@triton.jit`` function with the same ``[grid](...)`` call. Its
first launch per configuration goes through Triton (which compiles or finds the kernel); later ones launch the
compiled kernel directly, found by a key made of each runtime argument's specialisation as Triton itself computes
it (``native_specialize_impl``: dtype, 16-byte alignment, integer width and divisibility, ``== 1``), the
constexpr values and the launch options.

Under the interpreter, for arguments off the GPU (the first runtime argument, a tensor or a host tensor descriptor,
tells) or for a grid given as a function, the call is Triton's own.

Programmatic dependent launch (Hopper): a kernel that declares the constexpr ``PDL`` (default False) and calls
``pdl_wait(PDL)`` as its first statement is launched with ``PDL=True`` and the ``launch_pdl`` option on a GPU that
has it. Its programs may then be scheduled while the kernel before it in the stream is still running; they wait in
``pdl_wait`` until that kernel has finished and its writes are visible, then at once let the next kernel's programs
be scheduled too. A decode step is a chain of about a hundred small kernels, each a few microseconds long: what
this hides is each kernel's launch and its programs' start behind the kernel before it. Since every such kernel
waits before any memory access, and the wait returns only once the kernel before has finished, the order of a
stream is kept across any mix of kernels with and without it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.driver import driver
from triton.tools.tensor_descriptor import TensorDescriptor

from flashinfra import env
from flashinfra.kernels.dispatch import interpreting

# Triton specialises a pointer argument on whether its address is a multiple of this many bytes: a tensor handed to a
# kernel whose start moves with a batch's sizes compiles a second variant of that kernel for the batches it misses
# (the packed step inputs, ``model/staging.py``, and the varlen index tensors, ``kernels/varlen.py``, align to it).
POINTER_ALIGN_BYTES = 16


# Host-side sizes of grids and blocks. Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr
# functions, callable in kernels too, and cost microseconds a call on the host: an eager step makes hundreds of calls.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's first statement where it takes ``PDL``: wait for the kernel before it in the stream to finish,
    then let the next one's programs start (nothing when launched without it)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_pdl_devices: dict[int, dict] = {}
_PDL_ON = {"PDL": True, "launch_pdl": True}
_pdl_held_off: contextvars.ContextVar[bool] = contextvars.ContextVar("flashinfra_pdl_held_off", default=False)


@contextlib.contextmanager
def without_pdl() -> Iterator[None]:
    """Within the block (for that thread or task, as ``dispatch.kernel_path``), kernels launch after the one before has
    finished, whatever ``FLASHINFRA_PDL`` says (a graph captured within keeps it): a kernel's profiled time then holds
    no wait for the kernel before it, which with PDL it does, so per-kernel times add up to a step only without it
    (``bench/hotpath_profile.py``)."""
    token = _pdl_held_off.set(True)
    try:
        yield
    finally:
        _pdl_held_off.reset(token)


def pdl_options(device: torch.device | int) -> dict:
    """The launch arguments of a ``PDL`` kernel on ``device`` (a GPU's index, or a device): ``PDL`` and
    ``launch_pdl`` where the GPU has programmatic dependent launch (compute capability 9.0 and later) and
    ``FLASHINFRA_PDL`` does not turn it off; none off the GPU, under the interpreter and within ``without_pdl``."""
    if _pdl_held_off.get():
        return {}
    if isinstance(device, torch.device):
        if device.type != "cuda" or interpreting():
            return {}
        device = device.index if device.index is not None else torch.cuda.current_device()
    options = _pdl_devices.get(device)
    if options is None:
        on = env.programmatic_launch() and torch.cuda.get_device_capability(device)[0] >= 9
        options = _pdl_devices[device] = _PDL_ON if on else {}
    return options  # one dict per device, made once: it is read on every launch, never changed


class FastKernel:
    """``fn[grid](*args, **kwargs)`` with the compiled kernel kept per specialisation. Runtime arguments are given
    positionally; constexprs and launch options (``num_warps``, ``num_stages``, ``maxnreg``, ...) by name."""

    def __init__(self, fn: triton.runtime.JITFunction):
        self.fn = fn
        self.names = fn.arg_names
        self.defaults = {p.name: p.default for p in fn.params if p.has_default}
        # runtime arguments by position, constexprs by name: a constexpr's key is its value, a runtime argument's its
        # specialisation (a tensor by name would be keyed by the object itself, and kept)
        self.positional = min((p.num for p in fn.params if p.is_constexpr), default=len(fn.params))
        self.runtime = frozenset(p.name for p in fn.params if not p.is_constexpr)
        self.pdl = any(p.name == "PDL" and p.is_constexpr for p in fn.params)
        self._compiled: dict[tuple, object] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        if len(args) > self.positional or not self.runtime.isdisjoint(kwargs):
            raise TypeError(f"{self.fn.__name__}: runtime arguments go by position, constexprs by name")
        first = args[0]
        first = first.base if isinstance(first, TensorDescriptor) else first  # a descriptor's tensor names the GPU
        if interpreting() or callable(grid) or not isinstance(first, torch.Tensor) or not first.is_cuda:
            self.fn[grid](*args, **kwargs)
            return
        device = first.device.index
        if self.pdl and (pdl := pdl_options(device)):
            kwargs = {**kwargs, **pdl}
        key = (device, tuple([native_specialize_impl(BaseBackend, a, False, True, True) for a in args]),
               tuple(kwargs.items()))
        kept = self._compiled.get(key)
        if kept is None:  # Triton compiles (or finds) and launches it; the parameters after ``args`` are kept
            tail = tuple(kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[len(args):])
            self._compiled[key] = (self.fn[grid](*args, **kwargs), tail)
            return
        compiled, tail = kept
        stream = driver.active.get_current_stream(device)
        enter, leave = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
        if getattr(enter, "calls", True) or getattr(leave, "calls", True):  # a profiler's hooks: as Triton does
            meta = compiled.launch_metadata(grid, stream, *args, *tail)
        else:
            meta = enter = leave = None
        g = (*grid, 1, 1)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta, enter, leave,
                     *args, *tail)


_fast: dict[triton.runtime.JITFunction, FastKernel] = {}


def fast(fn):
    """``fn``'s FastKernel, made once per kernel (anything but a JIT function, such as a benchmark's recorder put
    in its place, is returned as it is)."""
    if not isinstance(fn, triton.runtime.JITFunction):
        return fn
    kernel = _fast.get(fn)
    if kernel is None:
        kernel = _fast[fn] = FastKernel(fn)
    return kernel


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def device_descriptors() -> None:
    """Let kernels make tensor descriptors on the device (``tl.make_tensor_descriptor``): Triton's launcher then
    allocates a scratch per launch (128 bytes a program) through the allocator set here, from PyTorch's caching
    allocator on the current stream. The allocator is Triton's context variable, so it is set in each calling
    context; an allocator set before (by another library) is kept."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
