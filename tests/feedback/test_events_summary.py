import json

import pytest

from flashinfra import cli
from flashinfra.feedback.events import EventLog
from flashinfra.feedback.events_summary import format_text, summarize


def _step(start, dur, prefill, decode, reqs):
    return {"kind": "step", "ts": start, "start": start, "end": start + dur, "duration_s": dur,
            "num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_reqs": reqs}


def _events():
    ev = [_step(100.0, 0.1, 50, 0, 1), _step(100.2, 0.1, 0, 4, 4), _step(100.9, 0.1, 0, 4, 4)]
    ev.append({"kind": "transfer", "ts": 100.15, "start": 100.15, "end": 100.25, "duration_s": 0.1,
               "bytes": 1e8})
    ev.append({"kind": "preempt", "ts": 100.5, "reason": "no free blocks"})
    ev.append({"kind": "queue_wait", "ts": 100.2, "wait_s": 0.05})
    ev.append({"kind": "cache", "ts": 100.3, "used_blocks": 30, "total_blocks": 40, "used_slots": 1,
               "total_slots": 8})
    ev.append({"kind": "cache", "ts": 100.95, "used_blocks": 10, "total_blocks": 40})
    ev.append({"kind": "gil_stall", "ts": 100.6, "duration_s": 0.2})
    return ev


def test_summary_figures():
    s = summarize(_events(), windows=4)
    assert s["wall_s"] == pytest.approx(1.0)
    st = s["steps"]
    assert st["count"] == 3 and st["prefill_tokens"] == 50 and st["decode_tokens"] == 8
    assert st["tokens_per_s"] == pytest.approx(58 / 1.0)
    assert st["busy_fraction"] == pytest.approx(0.3)
    assert st["gap_s"]["max"] == pytest.approx(0.6) and st["gap_s"]["total"] == pytest.approx(0.7)
    assert s["transfers"]["bytes_per_s"] == pytest.approx(1e9)
    assert s["transfers"]["overlap_with_steps"] == pytest.approx(0.5)  # 100.2-100.25 and ... 100.15 -> 100.2 idle
    assert s["preemptions"] == {"count": 1, "by_reason": {"no free blocks": 1}}
    assert s["cache_usage"]["blocks"] == {"last": 0.25, "max": 0.75}
    assert s["gil_stalls"]["max"] == pytest.approx(0.2)
    tl = s["timeline"]
    assert [r["steps"] for r in tl] == [2, 0, 0, 1]
    assert [r["preemptions"] for r in tl] == [0, 0, 1, 0]
    assert tl[0]["busy_fraction"] == pytest.approx(0.15 / 0.25)  # the second step straddles windows 0 and 1
    assert tl[1]["busy_fraction"] == pytest.approx(0.05 / 0.25)
    assert tl[3]["busy_fraction"] == pytest.approx(0.1 / 0.25)
    text = format_text(s)
    assert "steps: 3" in text and "preemptions: 1" in text and "50% overlapped" in text


def test_cli_summarizes_a_file_written_by_event_log(tmp_path, capsys):
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        for i in range(5):
            with log.span("step", step=i, num_reqs=2) as ev:
                ev["num_decode_tokens"] = 2
        log.emit("preempt", reason="x")
    assert cli.main(["events", "summarize", str(path), "--json", "--windows", "3"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["steps"]["count"] == 5 and s["steps"]["decode_tokens"] == 10 and len(s["timeline"]) == 3
    assert cli.main(["events", "summarize", str(path)]) == 0
    assert "steps: 5" in capsys.readouterr().out


def test_empty_file(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text("")
    assert format_text(summarize(path)) == "no events"


def test_cli_missing_or_malformed_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["events", "summarize", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "step"}\n{"kind": "step", "ts": 1}\n')
    assert cli.main(["events", "summarize", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
