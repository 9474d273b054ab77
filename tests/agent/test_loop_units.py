"""A/B statistic, journal, LLM client, crash/resume and budgets of the loop, and the gate's guardrail
backstop."""

import json
import os
import textwrap

import pytest

from flashinfra.agent import tools
from flashinfra.agent.campaign import Campaign
from flashinfra.agent.journal import REDACTED, Journal, read
from flashinfra.agent.chat_client import ChatClient, LLMError
from flashinfra.agent.loop import Loop
from flashinfra.feedback import stats
from tests.agent.scripted_llm import ScriptedLLM


def test_compare_blocks_verdicts():
    base = [[1.00, 1.01, 0.99], [1.02, 1.00, 1.01]]
    assert stats.compare_blocks(base, [[0.70, 0.71, 0.69], [0.70, 0.72, 0.71]]).verdict == "better"
    assert stats.compare_blocks(base, [[1.30, 1.31, 1.29], [1.33, 1.30, 1.32]]).verdict == "worse"
    same = stats.compare_blocks(base, [[1.00, 1.02, 0.99], [1.01, 1.00, 1.01]])
    assert same.verdict == "no difference" and abs(same.change) < 0.02
    # A noisy baseline (A/A apart by 50%) hides a 30% gain.
    noisy = stats.compare_blocks([[1.0, 1.0, 1.0], [1.5, 1.5, 1.5]], [[0.85] * 3] * 2)
    assert noisy.verdict == "no difference" and noisy.noise_floor == pytest.approx(0.4, abs=0.01)
    # So does a noisy candidate: a 9.5% lower pooled median (p < 0.05) from subprocesses 10% apart is no gain.
    split = stats.compare_blocks(base, [[0.86, 0.87, 0.86], [0.95, 0.96, 0.95]])
    assert split.p_value < 0.05 and split.change == pytest.approx(0.095, abs=0.001)
    assert split.verdict == "no difference" and split.noise_floor == pytest.approx(0.099, abs=0.001)
    assert stats.compare_blocks([[2.0] * 3, [2.0] * 3], [[3.0] * 3] * 2, direction="higher").verdict == "better"
    with pytest.raises(ValueError):
        stats.compare_blocks([[1.0]], [[1.0, 2.0]])


def test_journal_redacts_and_survives_a_torn_line(tmp_path):
    j = Journal(tmp_path / "j.jsonl", secrets=("sk-123",))
    j.write("message", message={"content": "key sk-123 here", "nested": [{"k": "sk-123"}]})
    text = (tmp_path / "j.jsonl").read_text()
    assert "sk-123" not in text and text.count(REDACTED) == 2
    with open(tmp_path / "j.jsonl", "a") as f:
        f.write('{"kind": "tool_ca')
    assert [r["kind"] for r in read(tmp_path / "j.jsonl")] == ["message"]
    (tmp_path / "bad.jsonl").write_text('{"kind": "a"}\nnot json\n{"kind": "b"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        list(read(tmp_path / "bad.jsonl"))


def test_llm_client_retries_and_errors():
    turns = [[("list_files", {"path": "."})]]
    with ScriptedLLM(turns, fail_first=2) as llm:
        client = ChatClient(llm.base_url, "scripted", "sk-secret-abc", backoff_s=0.01)
        reply = client.complete([{"role": "user", "content": "hi"}], tools.openai_tools(tools.FEEDBACK_SPECS))
        assert reply.message["tool_calls"][0]["function"]["name"] == "list_files"
        assert reply.prompt_tokens > 0 and len(llm.requests) == 3
        assert llm.requests[-1]["tools"][0]["function"]["name"] == "list_files"
        assert llm.headers[-1]["Authorization"] == "Bearer sk-secret-abc"
        bad = ChatClient(llm.base_url.replace("/v1", "/nope"), "scripted", "sk-secret-abc", backoff_s=0.01)
        with pytest.raises(LLMError, match="HTTP 404") as err:
            bad.complete([], [])
        assert "sk-secret-abc" not in str(err.value)
        client.close()
        bad.close()
    with pytest.raises(LLMError, match="no endpoint"):
        ChatClient("", "m")


class Crash(BaseException):
    """Stands for the process dying mid-tool (not an error the loop may catch)."""


def _goals(tmp_path, repo, iterations=20):
    path = tmp_path / f"goals-{iterations}.toml"
    path.write_text(textwrap.dedent(f"""
        [campaign]
        name = "resume{iterations}"
        providers = ["engine.checks"]
        [[criterion]]
        expr = "kernel.rowsum / kernel.copy <= 3"
        [guardrails]
        editable = ["engine/**"]
        [budgets]
        iterations = {iterations}
        """))
    return path


def test_resume_after_a_crash(repo, tmp_path, monkeypatch):
    goals = _goals(tmp_path, repo)
    turns = [[("new_candidate", {"hypothesis": "h1"})],
             [("read_file", {"path": "engine/rowsum.py", "candidate": "c1"}), ("list_files", {"path": "engine"})],
             [("show_diff", {"candidate": "c1"})],
             [("finish", {"summary": "done"})]]
    real_read = tools.CampaignTools.read_file

    def crashing_read(self, *args, **kwargs):
        raise Crash()

    monkeypatch.setattr(tools.CampaignTools, "read_file", crashing_read)
    with ScriptedLLM(turns) as llm:
        campaign = Campaign.open(goals, repo=repo)
        with pytest.raises(Crash):
            Loop(campaign, ChatClient(llm.base_url, "m")).run()
        monkeypatch.setattr(tools.CampaignTools, "read_file", real_read)
        resumed = Campaign.open(goals, repo=repo, must_exist=True)
        assert resumed.resumed and list(resumed.candidates) == ["c1"]
        loop = Loop(resumed, ChatClient(llm.base_url, "m"))
        assert loop.turns == 2
        assert loop.run() == "finished"
        final = llm.requests[-1]["messages"]
    answers = {m["tool_call_id"]: m["content"] for m in final if m["role"] == "tool"}
    assert answers["call_1_0"].startswith("interrupted") and answers["call_1_1"].startswith("interrupted")
    assert answers["call_2_0"] == "(no change)"
    kinds = [r["kind"] for r in read(resumed.journal.path)]
    assert kinds.count("campaign_start") == 1 and "resume" in kinds and kinds[-1] == "campaign_end"
    assert "## End" in (resumed.dir / "report.md").read_text()


def test_budget_stops_the_loop(repo, tmp_path):
    goals = _goals(tmp_path, repo, iterations=2)
    with ScriptedLLM([[("list_files", {})]] * 5) as llm:
        campaign = Campaign.open(goals, repo=repo)
        reason = Loop(campaign, ChatClient(llm.base_url, "m")).run()
    assert reason == "budget: iteration budget spent (2/2)" and len(llm.requests) == 2
    assert Loop(Campaign.open(goals, repo=repo, must_exist=True), None).run() == "campaign already finished"


def test_gate_backstop_for_read_only_edits_and_symlinks(repo, tmp_path):
    campaign = Campaign.open(_goals(tmp_path, repo), repo=repo)
    c = campaign.new_candidate("edit the evidence directly")
    tree = campaign.tree(c.id)
    (tree / "engine" / "checks.py").write_text("# nothing to check\n")
    os.symlink("/etc/hostname", tree / "engine" / "host.txt")
    campaign.submit(c.id, "")
    reasons = campaign.candidates[c.id].verdict["reasons"]
    assert any("engine/checks.py is read-only" in r for r in reasons)
    assert any("engine/host.txt is a symlink" in r for r in reasons)
    assert campaign.candidates[c.id].commit is None
    assert not (campaign.dir / "runs").exists() or not any((campaign.dir / "runs").iterdir())
    records = [json.loads(line) for line in campaign.journal.path.read_text().splitlines()]
    assert [r["kind"] for r in records if r["kind"] == "measurement"] == []


def test_runaway_candidate_is_killed_and_fails(repo, tmp_path):
    goals = _goals(tmp_path, repo)
    goals.write_text(goals.read_text() + "[sandbox]\ntimeout_s = 5\n")
    campaign = Campaign.open(goals, repo=repo)
    c = campaign.new_candidate("spin forever")
    rowsum = campaign.tree(c.id) / "engine" / "rowsum.py"
    rowsum.write_text("while True:\n    pass\n" + rowsum.read_text())
    campaign.submit(c.id, "")
    verdict = campaign.candidates[c.id].verdict
    assert not verdict["passed"] and verdict["reasons"] == ["candidate run killed at the 5 s timeout"]
    assert verdict["runs"][0]["timed_out"]
    start = campaign.journal.records()[0]
    assert start["limits"]["timeout_s"] == 5 and start["network_isolation"]


def test_endpoint_error_leaves_the_campaign_resumable(repo, tmp_path):
    goals = _goals(tmp_path, repo)
    with ScriptedLLM([]) as llm:
        campaign = Campaign.open(goals, repo=repo)
        reason = Loop(campaign, ChatClient(llm.base_url.replace("/v1", "/gone"), "m", backoff_s=0.01)).run()
        assert reason.startswith("endpoint error (resumable): HTTP 404")
        resumed = Campaign.open(goals, repo=repo, must_exist=True)
        assert not resumed.finished
        assert Loop(resumed, ChatClient(llm.base_url, "m")).run() == "the model stopped calling tools"


def test_approve_refuses_a_conflicting_merge_cleanly(repo, tmp_path):
    from flashinfra.agent import review, worktree

    campaign = Campaign.open(_goals(tmp_path, repo), repo=repo)
    c = campaign.new_candidate("change rowsum")
    (campaign.tree(c.id) / "engine" / "rowsum.py").write_text("# candidate\n")
    c.commit = worktree.commit_all(campaign.tree(c.id), "candidate")
    c.status = "passed"  # as if the gate had passed it: this test is about the merge
    (repo / "engine" / "rowsum.py").write_text("# meanwhile on main\n")
    worktree.git(repo, "commit", "-qam", "main moved", identity=True)
    with pytest.raises(worktree.GitError, match="merge"):
        review.approve(campaign, c.id)
    assert worktree.dirty(repo) == [] and (repo / "engine" / "rowsum.py").read_text() == "# meanwhile on main\n"
    assert campaign.candidates[c.id].status == "passed"
