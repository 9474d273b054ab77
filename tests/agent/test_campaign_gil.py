"""Acceptance: the GIL-stalled transfer thread, found by the GIL probe and the overhead criterion."""

import re

from flashinfra.agent.campaign import Campaign
from flashinfra.cli import main
from tests.agent.fixture_repo import FIXES
from tests.agent.scripted_llm import ScriptedLLM


def _edit(cid, fix):
    path, old, new = fix
    return ("edit_file", {"candidate": cid, "path": path, "old_text": old, "new_text": new})


def _summarize_probe_events(messages):
    probe = [m["content"] for m in messages if m.get("role") == "tool" and "runtime events:" in m["content"]]
    return [("summarize_events", {"path": re.search(r"runtime events: (\S+)", probe[-1]).group(1)})]


def test_transfer_campaign(repo, api_key):
    fixes = FIXES["transfer"]
    turns = [
        [("run_benchmarks", {})],
        [("gil_probe", {"names": ["prefill_with_transfer"]})],
        _summarize_probe_events,
        [("new_candidate", {"hypothesis": "sum(bytes) holds the GIL for the whole page; a numpy reduction "
                                          "gives the same sum and releases it"}),
         _edit("c1", fixes["correct"]), ("submit_candidate", {"candidate": "c1"})],
        [("new_candidate", {"hypothesis": "skip the checksum"}), _edit("c2", fixes["breaks"]),
         ("submit_candidate", {"candidate": "c2"})],
        [("new_candidate", {"hypothesis": "a list() literal is faster"}), _edit("c3", fixes["noop"]),
         ("submit_candidate", {"candidate": "c3"})],
        [("finish", {"summary": "c1 releases the GIL in the transfer checksum"})],
    ]
    with ScriptedLLM(turns) as llm:
        assert main(["agent", "run", "--goals", str(repo / "goals/transfer.toml"), "--base-url", llm.base_url,
                     "--model", "scripted"]) == 0
        results = llm.tool_results()

    # Signals: the overhead criterion fails; the probe names the transfer thread inside checksum().
    bench = results["call_0_0"]
    value = float(re.search(r"transfer overhead at most 5%'.*\(value ([\d.]+)\) -> NOT MET", bench).group(1))
    assert value > 1.05
    probe = results["call_1_0"]
    assert re.search(r"[1-9]\d* stall\(s\)", probe)
    assert "kv-transfer: " in probe and "in checksum: return sum(page.numpy().tobytes())" in probe
    assert "gil_stall" in results["call_2_0"]

    c = Campaign.open(repo / "goals/transfer.toml", must_exist=True).candidates
    assert c["c1"].status == "passed", c["c1"].verdict["reasons"]
    assert c["c1"].verdict["criteria"][0]["value"] <= 1.05
    assert c["c2"].status == "failed"
    assert any("check transfer.roundtrip failed" in r and "transfer.checksums" in r for r in c["c2"].verdict["reasons"])
    assert c["c3"].status == "failed"
    assert any("no improvement beyond the noise floor" in r for r in c["c3"].verdict["reasons"])
