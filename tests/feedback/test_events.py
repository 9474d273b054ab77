import json
import threading

import pytest

from flashinfra.feedback.events import EventLog, read_events


def test_disabled_log_records_nothing(tmp_path):
    log = EventLog(None)
    assert not log.enabled
    log.emit("step", step=1)
    with log.span("transfer", bytes=10) as ev:
        ev["extra"] = 1
    assert log.prometheus_text() == ""
    assert list(tmp_path.iterdir()) == []


def test_emit_and_span_write_jsonl(tmp_path):
    path = tmp_path / "ev.jsonl"
    with EventLog(path) as log:
        log.emit("preempt", request_id="r1", reason="no blocks")
        with log.span("step", step=3, num_reqs=2) as ev:
            ev["num_decode_tokens"] = 2
    events = read_events(path)
    assert [e["kind"] for e in events] == ["preempt", "step"]
    step = events[1]
    assert step["num_decode_tokens"] == 2 and step["step"] == 3
    assert step["end"] >= step["start"] and step["duration_s"] >= 0
    assert step["thread"] == threading.current_thread().name


def test_span_records_error_and_reraises(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path)
    with pytest.raises(RuntimeError):
        with log.span("transfer", bytes=5):
            raise RuntimeError("link down")
    log.close()
    (event,) = read_events(path)
    assert event["error"] == "RuntimeError: link down"


def test_threads_do_not_interleave_lines(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, flush_every=64)

    def work(i):
        for j in range(500):
            log.emit("tick", worker=i, j=j, payload="x" * 200)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    events = read_events(path)
    assert len(events) == 8 * 500
    assert sorted((e["worker"], e["j"]) for e in events) == [(i, j) for i in range(8) for j in range(500)]


def test_prometheus_counters_and_histogram():
    log = EventLog(None, prometheus=True)
    assert log.enabled
    for n in (3, 4):
        with log.span("step", num_prefill_tokens=n):
            pass
    log.emit("preempt")
    text = log.prometheus_text()
    assert 'flashinfra_events_total{kind="step"} 2.0' in text
    assert 'flashinfra_events_total{kind="preempt"} 1.0' in text
    assert 'flashinfra_span_seconds_count{kind="step"} 2.0' in text
    assert 'flashinfra_event_field_total{field="num_prefill_tokens",kind="step"} 7.0' in text


def test_read_events_rejects_malformed_line_but_skips_torn_tail(tmp_path):
    path = tmp_path / "ev.jsonl"
    good = json.dumps({"kind": "a", "ts": 1.0})
    path.write_text(good + "\n" + '{"kind": "b", "ts"')
    assert len(read_events(path)) == 1
    path.write_text('{"kind": "b"\n' + good + "\n")
    with pytest.raises(ValueError, match=":1:"):
        read_events(path)
