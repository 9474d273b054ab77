"""``CompileWatch``: one ``kernel_compile`` event per Triton compilation, with the hooks installed before it still
called and put back on stop; on a GPU, a kernel met at a new specialisation after the watch starts is reported
and one met again is not; and the events summary totals them by kernel."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flashinfra.feedback.compiles import CompileWatch, KeptCompiles
from flashinfra.feedback.events import EventLog, read_events
from flashinfra.feedback.events_summary import format_text, summarize


class Info:
    name = "some_kernel"


def test_each_compilation_is_one_event_and_earlier_hooks_still_run(tmp_path, monkeypatch):
    runtime = triton.knobs.runtime
    calls = []
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kw: calls.append(("miss", kw["key"])) or False)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", lambda **kw: calls.append(("done", kw["key"])))
    before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    log = EventLog(tmp_path / "events.jsonl")
    watch = CompileWatch(log).start()
    watch.phase = "serving"
    for key in ("a", "b"):
        compiled = {"signature": {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}, "constants": {(2,): 64},
                    "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]} if key == "a"
                                else {(0,): [["tt.divisibility", 16]]}]}
        hook = dict(key=key, repr="some_kernel[num_warps=4](x: *fp32, n: i32)", fn=Info(), compile=compiled)
        assert runtime.jit_cache_hook(**hook) is False  # Triton compiles on
        runtime.jit_post_compile_hook(**hook)
    watch.stop()
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == before
    assert calls == [("miss", "a"), ("done", "a"), ("miss", "b"), ("done", "b")]
    events = read_events(tmp_path / "events.jsonl")
    assert [(e["kernel"], e["spec"]) for e in events] == [
        ("some_kernel", "some_kernel[num_warps=4] constexprs {'BLOCK': 64} divisible by 16 ['n', 'x']"),
        ("some_kernel", "some_kernel[num_warps=4] constexprs {'BLOCK': 64} divisible by 16 ['x']")]
    assert watch.count == 2 and all(e["duration_s"] >= 0 and e["phase"] == "serving" for e in events)
    s = summarize(events)
    assert s["kernel_compiles"]["by_kernel"]["some_kernel"]["count"] == 2
    assert "kernel compilations after start-up: 2" in format_text(s)


def test_a_benchmark_keeps_compilations_without_an_event_log():
    kept = KeptCompiles()  # what a CompileWatch emits into it
    for kernel, spec, seconds in (("k_a", "spec a", 0.25), ("k_b", "spec b", 0.5), ("k_a", "spec c", 1.0)):
        kept.emit("kernel_compile", kernel=kernel, spec=spec, duration_s=seconds, phase="serving")
    s = kept.summary()
    assert (s["count"], s["seconds"]) == (3, 1.75)
    assert s["by_kernel"] == {"k_a": {"count": 2, "seconds": 1.25}, "k_b": {"count": 1, "seconds": 0.5}}
    assert [x["spec"] for x in s["specs"]] == ["spec a", "spec b", "spec c"]


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_specialisation_on_the_gpu_is_reported(tmp_path):
    x = torch.zeros(64, device="cuda")
    _add_one[(1,)](x, 64, BLOCK=64)  # n % 16 == 0: compiled before the watch
    log = EventLog(tmp_path / "events.jsonl")
    watch = CompileWatch(log).start()
    try:
        _add_one[(1,)](x, 64, BLOCK=64)  # met before: no compilation
        _add_one[(1,)](x, 63, BLOCK=64)  # n % 16 != 0: a new specialisation
    finally:
        watch.stop()
    torch.cuda.synchronize()
    events = read_events(tmp_path / "events.jsonl")
    assert [e["kernel"].rsplit(".", 1)[-1] for e in events] == ["_add_one"]
    assert x[:63].eq(3).all() and x[63].item() == 2


def test_watches_stopped_out_of_order_leave_working_hooks(tmp_path, monkeypatch):
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    monkeypatch.setattr(runtime, "jit_post_compile_hook", None)
    first, second = EventLog(tmp_path / "a.jsonl"), EventLog(tmp_path / "b.jsonl")
    a = CompileWatch(first).start()
    b = CompileWatch(second).start()
    a.stop()  # b's hooks stay installed and call a's, which now only pass the call on
    hook = dict(key="k", repr="k[]", fn=Info(), compile={})
    runtime.jit_cache_hook(**hook)
    runtime.jit_post_compile_hook(**hook)
    assert a.count == 0 and b.count == 1
    b.stop()
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) != b._hooks  # b put back what it found: a's
    runtime.jit_cache_hook(**hook)
    runtime.jit_post_compile_hook(**hook)
    assert a.count == 0 and b.count == 1
