"""Acceptance: the GIL-stalled transfer thread, found by the GIL probe and the overhead criterion."""

import re

from flashinfra.agent.campaign import Campaign
from flashinfra.cli import main
from tests.agent.fixture_repo import FIXES
from tests.agent.scripted_llm import ScriptedLLM

CORRECT = "sum(bytes) holds the GIL for the whole page; a numpy reduction gives the same sum and releases it"
TIMING = ("criterion 'transfer overhead", "target prefill_with_transfer: no improvement")


def _candidates(messages) -> int:
    return sum(1 for m in messages if m.get("role") == "tool" and re.match(r"candidate c\d+ created", m["content"]))


def _try(hypothesis, fix):
    """New candidate + edit + submit, numbered after the candidates the conversation already made."""
    def turn(messages):
        cid = f"c{_candidates(messages) + 1}"
        path, old, new = fix
        return [("new_candidate", {"hypothesis": hypothesis}),
                ("edit_file", {"candidate": cid, "path": path, "old_text": old, "new_text": new}),
                ("submit_candidate", {"candidate": cid})]
    return turn


def _remeasure_if_noise(messages):
    """What an agent does when the correct fix lost to timing noise only (a busy machine): measure a fresh
    candidate of the same fix."""
    last = [m["content"] for m in messages if m.get("role") == "tool"][-1]
    if "REJECTED" in last and not re.search(r"check |sandbox|failed|exit status|timeout", last):
        return _try(CORRECT, FIXES["transfer"]["correct"])(messages)
    return [("list_files", {"path": "engine"})]


def _summarize_probe_events(messages):
    found = [re.search(r"runtime events: (\S+)", m["content"]) for m in messages if m.get("role") == "tool"]
    paths = [f.group(1) for f in found if f]
    return [("summarize_events", {"path": paths[-1] if paths else "(the probe reported no event file)"})]


def test_transfer_campaign(repo, api_key):
    fixes = FIXES["transfer"]
    turns = [
        [("run_benchmarks", {})],
        [("gil_probe", {"names": ["prefill_with_transfer"]})],
        _summarize_probe_events,
        _try(CORRECT, fixes["correct"]),
        _remeasure_if_noise,
        _remeasure_if_noise,
        _try("skip the checksum", fixes["breaks"]),
        _try("a list() literal is faster", fixes["noop"]),
        [("finish", {"summary": "the transfer checksum now releases the GIL"})],
    ]
    with ScriptedLLM(turns) as llm:
        assert main(["agent", "run", "--goals", str(repo / "goals/transfer.toml"), "--base-url", llm.base_url,
                     "--model", "scripted"]) == 0
        results = llm.tool_results()

    # Signals: the overhead criterion fails; the probe names the transfer thread inside checksum().
    bench = results["call_0_0"]
    unmet = re.search(r"transfer overhead at most 25%'.*\(value ([\d.]+)\) -> NOT MET", bench)
    assert unmet and float(unmet.group(1)) > 1.25, bench
    probe = results["call_1_0"]
    assert re.search(r"[1-9]\d* stall\(s\)", probe)
    assert "kv-transfer: " in probe and "in checksum: return sum(page.numpy().tobytes())" in probe
    assert "gil_stall" in results["call_2_0"]

    by_hypothesis = {}
    for c in Campaign.open(repo / "goals/transfer.toml", must_exist=True).candidates.values():
        by_hypothesis.setdefault(c.hypothesis, []).append(c)
    correct = by_hypothesis[CORRECT]
    assert [c.status for c in correct][-1] == "passed", [c.verdict["reasons"] for c in correct]
    assert correct[-1].verdict["criteria"][0]["value"] <= 1.25
    assert all(r.startswith(TIMING) for c in correct[:-1] for r in c.verdict["reasons"])
    (breaks,) = by_hypothesis["skip the checksum"]
    assert breaks.status == "failed"
    assert any("check transfer.roundtrip failed" in r and "transfer.checksums" in r for r in breaks.verdict["reasons"])
    (noop,) = by_hypothesis["a list() literal is faster"]
    # The no-op leaves the GIL stall in place: timing rejects it (the overhead criterion, the target, or both:
    # noise on a busy machine can hide either one), never a check.
    assert noop.status == "failed"
    assert noop.verdict["reasons"] and all(r.startswith(TIMING) for r in noop.verdict["reasons"]), noop.verdict
