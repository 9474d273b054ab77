"""Human approval: ``review`` shows each passed candidate with its diff and evidence, ``approve`` merges
one, ``reject`` records why not. Nothing else lands a candidate.

``approve`` merges exactly the commit the gate judged (recorded with the verdict), not whatever the
candidate's branch or worktree holds now, and checks once more that it touches only editable paths.
"""

from __future__ import annotations

import os

from flashinfra.agent import report, worktree
from flashinfra.agent.campaign import Campaign


class ReviewError(RuntimeError):
    pass


def review_text(campaign: Campaign, cid: str | None = None) -> str:
    chosen = [campaign.candidate(cid)] if cid else [c for c in campaign.candidates.values()
                                                     if c.status == "passed"]
    if not chosen:
        others = ", ".join(f"{c.id} {c.status}" for c in campaign.candidates.values()) or "none"
        return f"No candidate waits for approval in campaign {campaign.goals.name} (candidates: {others})."
    parts = []
    for c in chosen:
        v = c.verdict or {}
        parts.append(f"=== {c.id} [{c.status}] {c.hypothesis}")
        parts.append(f"commit {c.commit or '(none)'} on {c.branch}")
        parts += [f"  {line}" for line in report.verdict_lines(v)]
        checks = {k: val for k, val in v.get("metrics", {}).get("B", {}).items() if k.endswith(".passed")}
        if checks:
            parts.append("  checks: " + ", ".join(f"{k[:-7]} {'pass' if val else 'FAIL'}" for k, val in checks.items()
                                                  if k.count(".") >= 1))
        if c.commit:
            parts.append(worktree.git(campaign.repo, "diff", "--no-color", campaign.base_sha, c.commit))
        if c.decision:
            parts.append(f"  decision: {c.decision['decision']} {c.decision.get('reason', '')}".rstrip())
    return "\n".join(parts)


def approve(campaign: Campaign, cid: str, reviewer: str | None = None) -> str:
    c = campaign.candidate(cid)
    if c.status != "passed" or not c.commit:
        raise ReviewError(f"candidate {cid} is {c.status}: only a candidate that passed the gate can be approved")
    changed = [p for p in worktree.git(campaign.repo, "diff", "--name-only", "--no-renames", campaign.base_sha,
                                       c.commit).splitlines() if p]
    problems = campaign.gate.guardrails.violations(changed)
    if problems:
        raise ReviewError(f"candidate {cid}'s commit breaks the guardrails: {'; '.join(problems)}")
    head = worktree.merge(campaign.repo, c.commit, f"Merge Infra Agent candidate {campaign.goals.name}/{cid}: "
                                                   f"{c.hypothesis}")
    c.status = "approved"
    c.decision = campaign.journal.write("decision", candidate=cid, decision="approved", merge=head,
                                        reviewer=reviewer or _whoami())
    report.write(campaign)
    return head


def reject(campaign: Campaign, cid: str, reason: str, reviewer: str | None = None) -> None:
    if not reason.strip():
        raise ReviewError("a rejection needs a reason")
    c = campaign.candidate(cid)
    if c.status == "approved":
        raise ReviewError(f"candidate {cid} was already approved and merged")
    c.status = "rejected"
    c.decision = campaign.journal.write("decision", candidate=cid, decision="rejected", reason=reason,
                                        reviewer=reviewer or _whoami())
    report.write(campaign)


def _whoami() -> str:
    try:
        return os.getlogin()
    except OSError:
        return "unknown"
