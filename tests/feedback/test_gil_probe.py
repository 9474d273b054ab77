"""The GIL probe on a planted fault: a thread holding the GIL in one long C call."""

import threading
import time

from flashinfra.feedback.events import EventLog, read_events
from flashinfra.feedback.gil_probe import GilProbe, parse_faulthandler_dump


def hold_the_gil(delay_s=0.0):
    time.sleep(delay_s)
    return sum(range(10**8))  # one C call: the interpreter never gets a chance to switch threads


def test_probe_reports_gil_holder_with_its_stack(tmp_path):
    log = EventLog(tmp_path / "ev.jsonl")
    with GilProbe(threshold_s=0.2, interval_s=0.01, events=log, native_stacks=True) as probe:
        hog = threading.Thread(target=hold_the_gil, args=(0.05,), name="hog")
        time.sleep(0.05)
        t0 = time.perf_counter()
        hog.start()
        hog.join()
        held = time.perf_counter() - t0
        time.sleep(0.05)  # let the heartbeat run once more after the stall
    log.close()
    assert probe.count >= 1, f"no stall seen though the GIL was held for {held:.2f}s"
    longest = max(probe.stalls, key=lambda s: s.duration_s)
    assert 0.2 <= longest.duration_s <= held + 0.1
    assert probe.max_s == longest.duration_s and probe.total_s >= longest.duration_s
    report = probe.report()
    assert report["probed_s"] >= held and 0 < report["stalled_fraction"] <= 1
    assert longest.source == "during"
    assert "MainThread" in longest.stacks_after  # the structured sys._current_frames() view, after the stall
    hog_stack = longest.stacks["hog"]
    assert "in hold_the_gil: return sum(range(10**8))" in hog_stack[-1]
    assert any("hog: " in line and "sum(range" in line for line in longest.culprit_lines())
    assert "sum(range(10**8))" in probe.format_text()
    (event,) = [e for e in read_events(tmp_path / "ev.jsonl") if e["duration_s"] == longest.duration_s]
    assert event["kind"] == "gil_stall" and "hog" in event["thread_stacks"]


def test_threads_that_release_the_gil_are_not_reported():
    with GilProbe(threshold_s=0.25, interval_s=0.01) as probe:
        workers = [threading.Thread(target=time.sleep, args=(0.3,)) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert probe.count == 0, probe.format_text()


def test_stacks_after_the_stall_by_default():
    with GilProbe(threshold_s=0.2, interval_s=0.01) as probe:  # the default: no native dump
        hold_the_gil()
        time.sleep(0.05)
    assert probe.count >= 1
    assert all(s.source == "after" for s in probe.stalls)
    assert "MainThread" in probe.stalls[0].stacks


def test_parse_faulthandler_dump_orders_frames_innermost_last():
    text = ('Thread 0x000000000000002a (most recent call first):\n'
            '  File "/x/inner.py", line 3 in inner\n'
            '  File "/x/outer.py", line 9 in outer\n')
    stacks = parse_faulthandler_dump(text, {42: "worker"})
    assert stacks == {"worker": ["/x/outer.py:9 in outer", "/x/inner.py:3 in inner"]}
