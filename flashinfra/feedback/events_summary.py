"""Turning a runtime event stream into a timeline summary (``flashinfra events summarize FILE``).

Reads what ``flashinfra.feedback.events`` writes. Per kind: counts, and for spans the duration
percentiles. For the engine's kinds: scheduler steps (tokens, throughput, batch sizes, busy fraction and
the idle gaps between steps), queue waits, preemptions by reason, cache usage, KV/state transfers (bytes,
bandwidth, how much of their time overlapped a step) and GIL stalls. Then a timeline: the run cut into
equal windows, each with its steps, tokens, busy fraction, preemptions, transfers and stalls, so a slow
phase is located in time.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from flashinfra.feedback.compiles import totals
from flashinfra.feedback.events import read_events


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"count": len(s), "mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
            "max": s[-1], "total": sum(s)}


def _interval(e: dict[str, Any]) -> tuple[float, float]:
    start = float(e.get("start", e["ts"]))
    return start, float(e.get("end", start))


def _overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b[1]) - max(a[0], b[0])) for b in spans)


def _num(e: dict[str, Any], key: str) -> float:
    value = e.get(key, 0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def summarize(source: str | os.PathLike | list[dict[str, Any]], windows: int = 10) -> dict[str, Any]:
    """Summary of an event file (or an already parsed list of events)."""
    events = read_events(source) if isinstance(source, (str, os.PathLike)) else list(source)
    if windows < 1:
        raise ValueError("windows must be >= 1")
    if not events:
        return {"events": 0, "kinds": {}}
    events.sort(key=lambda e: _interval(e)[0])
    t0 = min(_interval(e)[0] for e in events)
    t1 = max(_interval(e)[1] for e in events)
    wall = t1 - t0
    kinds = Counter(e["kind"] for e in events)
    out: dict[str, Any] = {"events": len(events), "start": t0, "end": t1, "wall_s": wall, "kinds": dict(kinds),
                           "spans": {k: _pct([e["duration_s"] for e in events if e["kind"] == k and "duration_s" in e])
                                     for k in kinds if any("duration_s" in e for e in events if e["kind"] == k)}}
    steps = [e for e in events if e["kind"] == "step"]
    step_spans = [_interval(e) for e in steps]
    if steps:
        prefill = sum(_num(e, "num_prefill_tokens") for e in steps)
        decode = sum(_num(e, "num_decode_tokens") for e in steps)
        busy = sum(b - a for a, b in step_spans)
        gaps = [max(0.0, b[0] - a[1]) for a, b in zip(step_spans, step_spans[1:])]
        step_wall = step_spans[-1][1] - step_spans[0][0]
        out["steps"] = {
            "count": len(steps), "prefill_tokens": prefill, "decode_tokens": decode,
            "tokens_per_s": (prefill + decode) / step_wall if step_wall > 0 else None,
            "busy_fraction": busy / step_wall if step_wall > 0 else None,
            "duration_s": _pct([b - a for a, b in step_spans]), "gap_s": _pct(gaps),
            "num_reqs": _pct([_num(e, "num_reqs") for e in steps if "num_reqs" in e])}
    waits = [_num(e, "wait_s") for e in events if e["kind"] == "queue_wait"]
    if waits:
        out["queue_wait_s"] = _pct(waits)
    preempts = [e for e in events if e["kind"] == "preempt"]
    if preempts:
        out["preemptions"] = {"count": len(preempts),
                              "by_reason": dict(Counter(str(e.get("reason", "?")) for e in preempts))}
    cache = [e for e in events if e["kind"] == "cache"]
    if cache:
        usage = {}
        for used, total in (("used_blocks", "total_blocks"), ("used_slots", "total_slots")):
            fracs = [_num(e, used) / _num(e, total) for e in cache if _num(e, total) > 0]
            if fracs:
                usage[used.removeprefix("used_")] = {"last": fracs[-1], "max": max(fracs)}
        out["cache_usage"] = usage
    transfers = [e for e in events if e["kind"] == "transfer"]
    if transfers:
        spans = [_interval(e) for e in transfers]
        seconds = sum(b - a for a, b in spans)
        nbytes = sum(_num(e, "bytes") for e in transfers)
        out["transfers"] = {"count": len(transfers), "bytes": nbytes, "duration_s": _pct([b - a for a, b in spans]),
                            "bytes_per_s": nbytes / seconds if seconds > 0 else None,
                            "overlap_with_steps": sum(_overlap(s, step_spans) for s in spans) / seconds
                            if seconds > 0 else None}
    stalls = [_num(e, "duration_s") for e in events if e["kind"] == "gil_stall"]
    if stalls:
        out["gil_stalls"] = _pct(stalls)
    compiles = [e for e in events if e["kind"] == "kernel_compile" and e.get("phase", "serving") == "serving"]
    if compiles:
        out["kernel_compiles"] = totals(compiles)
    out["timeline"] = _timeline(events, t0, wall, windows)
    return out


def _timeline(events: list[dict[str, Any]], t0: float, wall: float, windows: int) -> list[dict[str, Any]]:
    width = wall / windows if wall > 0 else 1.0
    rows = [{"start_s": i * width, "end_s": (i + 1) * width, "steps": 0, "tokens": 0.0, "busy_s": 0.0,
             "preemptions": 0, "transfers": 0, "gil_stall_s": 0.0, "queue_waits": 0} for i in range(windows)]
    for e in events:
        a, b = _interval(e)
        i = min(windows - 1, int((a - t0) / width))
        row, kind = rows[i], e["kind"]
        if kind == "step":
            row["steps"] += 1
            row["tokens"] += _num(e, "num_prefill_tokens") + _num(e, "num_decode_tokens")
            for j in range(i, min(windows, int((b - t0) / width) + 1)):  # busy time may span windows
                lo, hi = t0 + j * width, t0 + (j + 1) * width
                rows[j]["busy_s"] += max(0.0, min(b, hi) - max(a, lo))
        elif kind == "preempt":
            row["preemptions"] += 1
        elif kind == "transfer":
            row["transfers"] += 1
        elif kind == "gil_stall":
            row["gil_stall_s"] += _num(e, "duration_s")
        elif kind == "queue_wait":
            row["queue_waits"] += 1
    for row in rows:
        row["busy_fraction"] = row.pop("busy_s") / width
    return rows


def _ms(stats: dict[str, float]) -> str:
    if not stats.get("count"):
        return "none"
    return (f"n={stats['count']} p50 {stats['p50'] * 1e3:.2f} ms, p90 {stats['p90'] * 1e3:.2f} ms, "
            f"max {stats['max'] * 1e3:.2f} ms")


def format_text(s: dict[str, Any]) -> str:
    if not s.get("events"):
        return "no events"
    lines = [f"{s['events']} events over {s['wall_s']:.3f} s: "
             + ", ".join(f"{k} {n}" for k, n in sorted(s["kinds"].items()))]
    if "steps" in s:
        st = s["steps"]
        tps = f"{st['tokens_per_s']:.1f} tok/s" if st["tokens_per_s"] else "n/a"
        busy = f"{100 * st['busy_fraction']:.1f}%" if st["busy_fraction"] is not None else "n/a"
        lines += [f"steps: {st['count']}, {st['prefill_tokens']:.0f} prefill + {st['decode_tokens']:.0f} decode "
                  f"tokens, {tps}, busy {busy}",
                  f"  step duration {_ms(st['duration_s'])}", f"  gap between steps {_ms(st['gap_s'])}"]
        if st["num_reqs"].get("count"):
            lines.append(f"  batch size mean {st['num_reqs']['mean']:.1f}, max {st['num_reqs']['max']:.0f}")
    if "queue_wait_s" in s:
        lines.append(f"queue wait {_ms(s['queue_wait_s'])}")
    if "preemptions" in s:
        lines.append(f"preemptions: {s['preemptions']['count']} {s['preemptions']['by_reason']}")
    for kind, usage in s.get("cache_usage", {}).items():
        lines.append(f"cache {kind}: last {100 * usage['last']:.1f}%, max {100 * usage['max']:.1f}%")
    if "transfers" in s:
        t = s["transfers"]
        bw = f"{t['bytes_per_s'] / 1e9:.2f} GB/s" if t["bytes_per_s"] else "n/a"
        ov = (f", {100 * t['overlap_with_steps']:.0f}% overlapped with steps"
              if t["overlap_with_steps"] is not None else "")
        lines.append(f"transfers: {t['count']}, {t['bytes'] / 1e6:.1f} MB, {bw}{ov}; {_ms(t['duration_s'])}")
    if "gil_stalls" in s:
        lines.append(f"GIL stalls: {_ms(s['gil_stalls'])}, total {s['gil_stalls']['total'] * 1e3:.1f} ms")
    if "kernel_compiles" in s:
        c = s["kernel_compiles"]
        worst = sorted(c["by_kernel"].items(), key=lambda kv: -kv[1]["seconds"])[:5]
        lines.append(f"kernel compilations after start-up: {c['count']}, {c['seconds']:.2f} s; "
                     + ", ".join(f"{name} {k['count']} ({k['seconds']:.2f} s)" for name, k in worst))
    for kind, stats in sorted(s["spans"].items()):
        if kind not in ("step", "transfer"):
            lines.append(f"span {kind}: {_ms(stats)}")
    lines.append("timeline (window start s: steps, tokens, busy, preempt, transfers, GIL stall ms, queue waits):")
    for row in s["timeline"]:
        lines.append(f"  {row['start_s']:8.3f}: {row['steps']:5d} {row['tokens']:8.0f} "
                     f"{100 * row['busy_fraction']:5.1f}% {row['preemptions']:4d} {row['transfers']:4d} "
                     f"{row['gil_stall_s'] * 1e3:8.1f} {row['queue_waits']:4d}")
    return "\n".join(lines)
