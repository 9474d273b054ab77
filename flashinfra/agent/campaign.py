"""A campaign on disk: its directory, journal, base worktree, candidates, and how it is rebuilt from the
journal after a crash.

Layout (``<repo>/.flashinfra-agent/<name>/`` by default, ignored by git through its own ``.gitignore``)::

    journal.jsonl      every record (flashinfra.agent.journal)
    report.md          the readable report, rewritten after every verdict and at the end
    base/              worktree at the base revision (what the tools read when no candidate is named)
    candidates/cN/     one worktree per candidate, on branch ``infra-agent/<name>/cN``
    runs/run-NNNN/     each sandboxed evaluation: spec, result, violations, events

Candidate status: ``open`` (being edited), ``passed`` / ``failed`` (the gate's verdict), then
``approved`` / ``rejected`` (a person's decision). Only ``passed`` candidates can be approved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from flashinfra.agent import journal as journal_mod
from flashinfra.agent import sandbox, worktree
from flashinfra.agent.evaluate import Gate, Runner
from flashinfra.agent.campaign_goals import Goals, load_goals

STATE_DIR = ".flashinfra-agent"


@dataclass
class Candidate:
    id: str
    hypothesis: str
    branch: str
    tree: str
    status: str = "open"
    commit: str | None = None
    verdict: dict | None = None
    decision: dict | None = None
    edits: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def campaign_dir(repo: Path, name: str, override: str | Path | None = None) -> Path:
    if override:
        return Path(override).resolve()
    root = repo / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    ignore = root / ".gitignore"
    if not ignore.exists():
        ignore.write_text("*\n", encoding="utf-8")
    return root / name


class Campaign:
    """Opened fresh or from an existing journal; the single owner of the campaign's state."""

    def __init__(self, goals: Goals, repo: Path, directory: Path, secrets: tuple[str, ...] = ()):
        self.goals = goals
        self.repo = repo
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = journal_mod.Journal(self.dir / "journal.jsonl", secrets=secrets)
        self.secrets = secrets
        self.candidates: dict[str, Candidate] = {}
        self.finished = False
        self.base_sha = ""
        records = self.journal.records()
        self.resumed = bool(records)
        if records:
            self._replay(records)
        else:
            self.base_sha = worktree.rev_parse(repo, goals.base)
            self.journal.write("campaign_start", name=goals.name, goals_file=str(goals.path), repo=str(repo),
                               base=self.base_sha, goals=goals.describe(), limits=asdict(goals.sandbox),
                               network_isolation=sandbox.network_isolation()[1])
        self.base_tree = worktree.ensure_worktree(repo, self.dir / "base", self.base_sha)
        self.runner = Runner(goals, self.dir / "runs", secrets)
        self.gate = Gate(goals, self.runner, self.base_tree, self.base_sha)

    @classmethod
    def open(cls, goals_path: str | Path, repo: Path | None = None, directory: str | Path | None = None,
             secrets: tuple[str, ...] = (), must_exist: bool = False) -> "Campaign":
        goals = load_goals(goals_path)
        repo = worktree.toplevel(Path(repo or Path(goals_path).resolve().parent))
        path = campaign_dir(repo, goals.name, directory)
        if must_exist and not (path / "journal.jsonl").exists():
            raise FileNotFoundError(f"no campaign {goals.name!r} at {path}: run 'flashinfra agent run' first")
        return cls(goals, repo, path, secrets)

    def _replay(self, records: list[dict]) -> None:
        for r in records:
            kind = r["kind"]
            if kind == "campaign_start":
                self.base_sha = r["base"]
            elif kind == "candidate":
                self.candidates[r["id"]] = Candidate(r["id"], r["hypothesis"], r["branch"], r["tree"])
            elif kind == "edit" and r.get("ok") and r["candidate"] in self.candidates:
                self.candidates[r["candidate"]].edits.append(r["path"])
            elif kind == "verdict":
                c = self.candidates[r["candidate"]]
                c.status = "passed" if r["verdict"]["passed"] else "failed"
                c.verdict, c.commit = r["verdict"], r.get("commit")
            elif kind == "decision":
                c = self.candidates[r["candidate"]]
                c.status, c.decision = r["decision"], r
            elif kind == "campaign_end":
                self.finished = True

    def new_candidate(self, hypothesis: str) -> Candidate:
        cid = f"c{len(self.candidates) + 1}"
        branch = f"infra-agent/{self.goals.name}/{cid}"
        tree = worktree.ensure_worktree(self.repo, self.dir / "candidates" / cid, self.base_sha, branch)
        c = Candidate(cid, hypothesis, branch, str(tree))
        self.candidates[cid] = c
        self.journal.write("hypothesis", candidate=cid, text=hypothesis)
        self.journal.write("candidate", id=cid, hypothesis=hypothesis, branch=branch, tree=str(tree))
        return c

    def candidate(self, cid: str | None, *, editable: bool = False) -> Candidate:
        if cid not in self.candidates:
            raise KeyError(f"no candidate {cid!r}; have: {', '.join(self.candidates) or '(none: call new_candidate)'}")
        c = self.candidates[cid]
        if editable and c.status != "open":
            raise PermissionError(f"candidate {cid} is {c.status}: start a new candidate to change it")
        return c

    def tree(self, cid: str | None) -> Path:
        return self.base_tree if not cid else Path(self.candidate(cid).tree)

    def submit(self, cid: str, summary: str) -> Candidate:
        """Run the gate on an open candidate and record the verdict."""
        c = self.candidate(cid, editable=True)
        tree = Path(c.tree)
        verdict = self.gate.evaluate(tree, self.journal.write)
        if verdict["changed"] and not any("read-only" in r or "outside the editable" in r or "symlink" in r
                                          for r in verdict["reasons"]):
            c.commit = worktree.commit_all(tree, f"{cid}: {c.hypothesis}\n\n{summary}".strip())
        c.verdict = verdict
        c.status = "passed" if verdict["passed"] else "failed"
        self.journal.write("verdict", candidate=cid, summary=summary, verdict=verdict, commit=c.commit,
                           diff=worktree.diff(tree, self.base_sha)[:20000])
        return c

    def end(self, reason: str, summary: str = "") -> None:
        if not self.finished:
            self.journal.write("campaign_end", reason=reason, summary=summary,
                               candidates={cid: c.status for cid, c in self.candidates.items()})
            self.finished = True
