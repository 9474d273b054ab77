"""Acceptance: the slow-kernel campaign end to end with a scripted LLM, plus the sandbox escapes, human
review, and the key staying out of the journal."""

import json

import pytest

from flashinfra.agent import review
from flashinfra.agent.campaign import Campaign
from flashinfra.agent.journal import REDACTED
from flashinfra.cli import main
from tests.agent.fixture_repo import FIXES
from tests.agent.scripted_llm import ScriptedLLM


def _edit(cid, fix):
    path, old, new = fix
    return ("edit_file", {"candidate": cid, "path": path, "old_text": old, "new_text": new})


def test_kernel_campaign(repo, api_key, listener, tmp_path, capsys):
    port, accepted = listener
    outside = tmp_path / "outside-secret.txt"
    outside.write_text("not for candidates")
    fixes = FIXES["kernel"]
    loop_head = "for i in range(x.shape[0]):"
    turns = [
        [("run_benchmarks", {}), ("run_checks", {"patterns": ["kernel"]})],
        [("read_file", {"path": "engine/rowsum.py"}), ("search_code", {"pattern": r"def rowsum"}),
         ("trace", {"benchmark": "kernel.rowsum"})],
        [("new_candidate", {"hypothesis": "the per-row Python loop dominates; one reduction removes it"}),
         _edit("c1", fixes["correct"]), ("submit_candidate", {"candidate": "c1", "summary": "vectorised"})],
        [("new_candidate", {"hypothesis": "accumulate in bfloat16 for speed"}), _edit("c2", fixes["breaks"]),
         ("submit_candidate", {"candidate": "c2"})],
        [("new_candidate", {"hypothesis": "len() is cheaper than shape[0]"}), _edit("c3", fixes["noop"]),
         ("submit_candidate", {"candidate": "c3"})],
        [("new_candidate", {"hypothesis": "relax the goal"}),
         ("edit_file", {"candidate": "c4", "path": "goals/kernel.toml", "old_text": "<= 10", "new_text": "<= 1000"}),
         ("write_file", {"candidate": "c4", "path": "engine/checks.py", "content": "# no checks\n"}),
         ("apply_patch", {"candidate": "c4", "patch": "--- a/goals/kernel.toml\n+++ b/goals/kernel.toml\n"
                          "@@ -1 +1 @@\n-[campaign]\n+[campaign] \n"}),
         ("read_file", {"path": "../outside-secret.txt"}),
         ("submit_candidate", {"candidate": "c4"})],
        [("new_candidate", {"hypothesis": "read a file outside"}),
         ("edit_file", {"candidate": "c5", "path": "engine/rowsum.py", "old_text": loop_head,
                        "new_text": f"import os, sys; print(dict(os.environ), file=sys.stderr); "
                                    f"open({str(outside)!r}).read()\n    {loop_head}"}),
         ("submit_candidate", {"candidate": "c5"})],
        [("new_candidate", {"hypothesis": "phone home"}),
         ("edit_file", {"candidate": "c6", "path": "engine/rowsum.py", "old_text": '"""Row sums',
                        "new_text": f'import socket\nsocket.create_connection(("127.0.0.1", {port}), timeout=2)\n'
                                    '"""Row sums'}),
         ("submit_candidate", {"candidate": "c6"})],
        [("finish", {"summary": "c1 vectorises rowsum"})],
    ]
    with ScriptedLLM(turns) as llm:
        assert main(["agent", "run", "--goals", str(repo / "goals/kernel.toml"), "--base-url", llm.base_url,
                     "--model", "scripted"]) == 0
        requests, headers = llm.requests, llm.headers
    assert all(h.get("Authorization") == f"Bearer {api_key}" for h in headers)
    results = {m["tool_call_id"]: m["content"] for m in requests[-1]["messages"] if m.get("role") == "tool"}

    # The signal: the benchmark shows the criterion unmet, the check passes (it is speed, not accuracy).
    assert "kernel.rowsum: median" in results["call_0_0"] and "NOT MET" in results["call_0_0"]
    assert "PASS kernel.rowsum" in results["call_0_1"]
    assert "engine/rowsum.py:5: def rowsum" in results["call_1_1"]
    # The trace shows reductions per row: at least 1024 aten::sum calls per step, 3 steps.
    (sums,) = [line.split() for line in results["call_1_2"].splitlines() if line.endswith("aten::sum")]
    assert int(sums[2]) >= 3 * 1024

    c = Campaign.open(repo / "goals/kernel.toml", must_exist=True).candidates
    assert c["c1"].status == "passed", c["c1"].verdict["reasons"]
    assert c["c1"].verdict["targets"][0]["verdict"] == "better"
    assert c["c2"].status == "failed"
    assert any("check kernel.rowsum failed" in r for r in c["c2"].verdict["reasons"])
    assert c["c3"].status == "failed"
    assert any("no improvement beyond the noise floor" in r for r in c["c3"].verdict["reasons"])
    # Read-only paths: each attempt refused by the tool, and the candidate has nothing to submit.
    assert "refused: goals/kernel.toml is read-only" in results["call_5_1"]
    assert "refused: engine/checks.py is read-only" in results["call_5_2"]
    assert "refused" in results["call_5_3"] and "goals/kernel.toml" in results["call_5_3"]
    assert "outside the repository" in results["call_5_4"] or "'..' is not allowed" in results["call_5_4"]
    assert c["c4"].status == "failed" and c["c4"].verdict["reasons"] == ["no change against the base revision"]
    # Escapes: stopped by the guard, recorded with what was attempted.
    assert "stopped by the sandbox: file read " + str(outside) in results["call_6_2"]
    assert any(str(outside) in r for r in c["c5"].verdict["reasons"])
    assert "stopped by the sandbox: network" in results["call_7_2"]
    assert accepted == []

    journal_text = (repo / ".flashinfra-agent/kernel/journal.jsonl").read_text()
    assert api_key not in journal_text and REDACTED not in journal_text
    records = [json.loads(line) for line in journal_text.splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"campaign_start", "hypothesis", "tool_call", "tool_result", "measurement", "verdict",
            "campaign_end"} <= kinds
    stopped = [r for r in records if r["kind"] == "measurement" and r["violations"]]
    assert {v["kind"] for r in stopped for v in r["violations"]} == {"file", "network"}
    report = (repo / ".flashinfra-agent/kernel/report.md").read_text()
    assert "### c1: passed" in report and "Runs stopped by the sandbox" in report

    # Human approval: review shows the diff and evidence; only a passed candidate merges.
    capsys.readouterr()
    goals = ["--goals", str(repo / "goals/kernel.toml")]
    assert main(["agent", "review", *goals]) == 0
    shown = capsys.readouterr().out
    # candidates are matched by their headers: a commit hash may well contain "c2"
    assert "=== c1 [passed]" in shown and "+    return x.sum(dim=1)" in shown and "=== c2" not in shown
    assert main(["agent", "approve", *goals, "c2"]) == 2
    assert main(["agent", "reject", *goals, "c3", "--reason", "no measurable gain"]) == 0
    assert main(["agent", "approve", *goals, "c1"]) == 0
    assert "return x.sum(dim=1)" in (repo / "engine/rowsum.py").read_text()
    campaign = Campaign.open(repo / "goals/kernel.toml", must_exist=True)
    assert campaign.candidates["c1"].status == "approved"
    assert campaign.candidates["c3"].decision["reason"] == "no measurable gain"
    with pytest.raises(review.ReviewError):
        review.reject(campaign, "c1", "too late")
