"""With ``gil_probe_ms`` set, the engine runs the GIL probe and reports a stall as a runtime event."""

from __future__ import annotations

import json
import threading
import time

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.model.factory import write_tiny_checkpoint


def hold_the_gil(release: threading.Event) -> int:
    total = sum(range(3 * 10**7))  # one C call: the interpreter never gets to switch threads inside it
    release.wait(10)  # this frame stays on the thread's stack, the GIL free, until the probe has taken the stacks
    return total


def test_engine_reports_a_gil_stall_with_its_culprit(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=1)
    events = tmp_path / "events.jsonl"
    core = EngineCore(EngineConfig(model=str(ckpt), num_blocks=16, max_num_seqs=2, gil_probe_ms=50,
                                   events_path=str(events)))
    try:
        release = threading.Event()
        culprit = threading.Thread(target=hold_the_gil, args=(release,), name="culprit")
        culprit.start()
        deadline = time.monotonic() + 10
        while core.gil_probe.count == 0 and time.monotonic() < deadline:  # the stall recorded, its stacks taken
            time.sleep(0.01)
        release.set()
        culprit.join()
    finally:
        core.close()
        core.events.close()
    stalls = [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "gil_stall"]
    assert stalls, "no gil_stall event"
    assert max(s["duration_s"] for s in stalls) >= 0.05
    assert any("hold_the_gil" in json.dumps(s["thread_stacks"]) for s in stalls)


def test_no_probe_by_default(tmp_path):
    core = EngineCore(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "t", seed=1)), num_blocks=8,
                                   max_num_seqs=1))
    assert core.gil_probe is None
    core.close()
