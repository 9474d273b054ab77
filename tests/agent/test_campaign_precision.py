"""Acceptance: the precision loss that only shows at long sequence length, found by the checks."""

import difflib

from flashinfra.agent.campaign import Campaign
from flashinfra.cli import main
from tests.agent.fixture_repo import FIXES
from tests.agent.scripted_llm import ScriptedLLM


def _patch(repo, fix):
    path, old, new = fix
    before = (repo / path).read_text()
    after = before.replace(old, new)
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))


def test_precision_campaign(repo, api_key):
    fixes = FIXES["precision"]
    path, old, new = fixes["breaks"]
    turns = [
        [("run_checks", {})],
        [("new_candidate", {"hypothesis": "the carry between chunks is rounded to bfloat16"}),
         ("apply_patch", {"candidate": "c1", "patch": _patch(repo, fixes["correct"])}),
         ("show_diff", {"candidate": "c1"}), ("run_checks", {"patterns": ["scan"], "candidate": "c1"}),
         ("submit_candidate", {"candidate": "c1"})],
        [("new_candidate", {"hypothesis": "carry the first row"}),
         ("edit_file", {"candidate": "c2", "path": path, "old_text": old, "new_text": new}),
         ("submit_candidate", {"candidate": "c2"})],
        [("new_candidate", {"hypothesis": "document the chunk size"}),
         ("edit_file", {"candidate": "c3", "path": fixes["noop"][0], "old_text": fixes["noop"][1],
                        "new_text": fixes["noop"][2]}),
         ("submit_candidate", {"candidate": "c3"})],
        [("finish", {"summary": "c1 keeps the carry in float32"})],
    ]
    with ScriptedLLM(turns) as llm:
        assert main(["agent", "run", "--goals", str(repo / "goals/precision.toml"), "--base-url", llm.base_url,
                     "--model", "scripted"]) == 0
        results = llm.tool_results()

    # Signal: the long check fails from the first row of the second chunk on; the short one passes.
    checks = results["call_0_0"]
    assert "PASS scan.short" in checks and "FAIL scan.long" in checks
    assert "extent 256..20010" in checks
    assert "+    carry = torch.zeros(D, dtype=torch.float32)" in results["call_1_2"]
    assert "PASS scan.long" in results["call_1_3"]

    c = Campaign.open(repo / "goals/precision.toml", must_exist=True).candidates
    assert c["c1"].status == "passed", c["c1"].verdict["reasons"]
    assert c["c1"].verdict["targets"][0]["verdict"] == "better"
    assert c["c2"].status == "failed"
    assert any("check scan.long failed" in r for r in c["c2"].verdict["reasons"])
    assert c["c3"].status == "failed"
    assert any("check scan.long failed" in r for r in c["c3"].verdict["reasons"])
