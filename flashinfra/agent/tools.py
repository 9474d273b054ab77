"""The tools the model (or an MCP client) calls, with their JSON schemas.

``FeedbackTools`` reads and measures a tree: ``list_files``, ``read_file``, ``search_code``,
``run_checks``, ``run_benchmarks``, ``gil_probe``, ``trace``, ``summarize_events``, ``ab_test``. ``CampaignTools`` adds
what changes code and decides: ``new_candidate``, ``edit_file``, ``write_file``, ``apply_patch``,
``show_diff``, ``submit_candidate``, ``finish``. Every tool takes and returns plain JSON-able values; a
tool returns text written for the model, and raises ``ToolError`` (or a ``PermissionError``/``KeyError``/
``ValueError``) with a message the model can act on. Paths go through ``flashinfra.agent.paths``; code runs
only in ``flashinfra.agent.sandbox`` subprocesses.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Callable

from flashinfra.agent import worktree
from flashinfra.agent.evaluate import BLOCKS, Runner, bench_metrics
from flashinfra.agent.paths import PathError, confine
from flashinfra.feedback import goals as fb_goals
from flashinfra.feedback import stats

MAX_READ_LINES = 400
MAX_HITS = 100


class ToolError(RuntimeError):
    pass


def _schema(description: str, properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required)}}


_S, _LS = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
_CAND = {"type": "string", "description": "candidate id (c1, c2...); omit for the base revision"}

FEEDBACK_SPECS = {
    "list_files": _schema("List the repository's files under a directory.", {"path": _S, "candidate": _CAND}),
    "read_file": _schema("Read a file (numbered lines).", {"path": _S, "candidate": _CAND,
                         "start_line": {"type": "integer"}, "max_lines": {"type": "integer"}}, ("path",)),
    "search_code": _schema("Search files for a regular expression; returns path:line: text.",
                           {"pattern": _S, "path": _S, "candidate": _CAND}, ("pattern",)),
    "run_checks": _schema("Run correctness checks against float64 references (all when no patterns).",
                          {"patterns": _LS, "candidate": _CAND}),
    "run_benchmarks": _schema("Time benchmarks (the goals' when no names) and evaluate the acceptance "
                              "criteria on the measured figures.", {"names": _LS, "candidate": _CAND}),
    "gil_probe": _schema("Run benchmarks under the GIL probe: stalls, their durations and every thread's "
                         "stack during the stall; stalls also go to a runtime-event file.",
                         {"names": _LS, "candidate": _CAND}),
    "trace": _schema("Profile one benchmark with torch.profiler: Chrome trace file, top ops/kernels by time, "
                     "GPU idle gaps, time per step.", {"benchmark": _S, "candidate": _CAND}, ("benchmark",)),
    "summarize_events": _schema("Summarize a runtime-event JSONL file (from gil_probe or the repository).",
                                {"path": _S, "candidate": _CAND}, ("path",)),
    "ab_test": _schema("A/B experiment: candidate vs base revision, interleaved subprocess rounds, noise "
                       "floor and verdict per benchmark.", {"candidate": _S, "names": _LS}, ("candidate",)),
}

CAMPAIGN_SPECS = {
    "new_candidate": _schema("Start a candidate fix in its own git worktree; state the hypothesis it tests.",
                             {"hypothesis": _S}, ("hypothesis",)),
    "edit_file": _schema("Replace one exact, unique occurrence of old_text by new_text in a candidate.",
                         {"candidate": _S, "path": _S, "old_text": _S, "new_text": _S},
                         ("candidate", "path", "old_text", "new_text")),
    "write_file": _schema("Create or overwrite a file in a candidate.", {"candidate": _S, "path": _S,
                          "content": _S}, ("candidate", "path", "content")),
    "apply_patch": _schema("Apply a unified diff (git format, paths relative to the repository) to a "
                           "candidate.", {"candidate": _S, "patch": _S}, ("candidate", "patch")),
    "show_diff": _schema("Show a candidate's diff against the base revision.", {"candidate": _S}, ("candidate",)),
    "submit_candidate": _schema("Submit a candidate to the gate: guardrails, every check, interleaved A/B "
                                "against the base, acceptance criteria, targets beyond the noise floor.",
                                {"candidate": _S, "summary": _S}, ("candidate",)),
    "finish": _schema("End the campaign with a summary of what was found and tried.", {"summary": _S},
                      ("summary",)),
}


def openai_tools(specs: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": name, **spec}} for name, spec in specs.items()]


class FeedbackTools:
    """Measurement and reading tools over trees that ``tree_of(candidate)`` resolves."""

    specs = FEEDBACK_SPECS

    def __init__(self, goals, runner: Runner, tree_of: Callable[[str | None], Path], base_tree: Path):
        self.goals, self.runner, self.tree_of, self.base_tree = goals, runner, tree_of, base_tree

    def call(self, name: str, args: dict) -> str:
        if name not in self.specs:
            raise ToolError(f"unknown tool {name!r}; tools: {', '.join(self.specs)}")
        allowed = set(self.specs[name]["parameters"]["properties"])
        unknown = set(args) - allowed
        if unknown:
            raise ToolError(f"{name} takes {sorted(allowed)}, not {sorted(unknown)}")
        return getattr(self, name)(**args)

    def _files(self, tree: Path, path: str) -> list[str]:
        rel = confine(tree, path).relative_to(tree.resolve()).as_posix() if path not in ("", ".") else ""
        out = worktree.git(tree, "ls-files", "--cached", "--others", "--exclude-standard", "--", rel or ".")
        return [f for f in out.splitlines() if f and not (tree / f).is_symlink()]

    def list_files(self, path: str = ".", candidate: str | None = None) -> str:
        files = self._files(self.tree_of(candidate), path)
        return "\n".join(files[:500]) + (f"\n... {len(files) - 500} more" if len(files) > 500 else "")

    def read_file(self, path: str, candidate: str | None = None, start_line: int = 1,
                  max_lines: int = MAX_READ_LINES) -> str:
        target = confine(self.tree_of(candidate), path, must_exist=True)
        if target.is_dir():
            raise ToolError(f"{path} is a directory; use list_files")
        lines = target.read_text(encoding="utf-8", errors="replace").splitlines()
        start = max(1, int(start_line))
        chunk = lines[start - 1:start - 1 + min(int(max_lines), MAX_READ_LINES)]
        text = "\n".join(f"{start + i:5d}  {line}" for i, line in enumerate(chunk))
        end = start + len(chunk) - 1
        return text + (f"\n[lines {start}-{end} of {len(lines)}]" if end < len(lines) or start > 1 else "")

    def search_code(self, pattern: str, path: str = ".", candidate: str | None = None) -> str:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ToolError(f"bad regular expression: {exc}") from None
        tree = self.tree_of(candidate)
        hits = []
        for rel in self._files(tree, path):
            try:
                text = confine(tree, rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError, PathError):
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if regex.search(line):
                    hits.append(f"{rel}:{number}: {line.strip()[:200]}")
                    if len(hits) >= MAX_HITS:
                        return "\n".join(hits) + f"\n[stopped at {MAX_HITS} hits]"
        return "\n".join(hits) or "no match"

    def _run(self, candidate, tasks, **spec):
        run = self.runner.run(self.tree_of(candidate), tasks, **spec)
        if run.failure:
            raise ToolError(f"the run was stopped or failed ({run.workdir.name}): {run.failure}")
        return run

    def run_checks(self, patterns: list[str] | None = None, candidate: str | None = None) -> str:
        run = self._run(candidate, ["checks"], patterns=list(patterns or self.goals.checks))
        return run.result["checks"]["text"]

    def _bench_names(self, names):
        names = list(names or self.goals.benchmarks)
        if not names:
            raise ToolError("no benchmark named and the goals list none")
        return names

    def run_benchmarks(self, names: list[str] | None = None, candidate: str | None = None) -> str:
        run = self._run(candidate, ["bench"], benchmarks=self._bench_names(names), repeats=self.goals.repeats,
                        blocks=1)
        lines, blocks = [], {}
        for name, b in run.result["bench"].items():
            blocks[name] = [b["block_medians"]]
            last = b["last"]
            lines.append(f"{name}: median {last['median_s'] * 1e3:.3f} ms (p10 {last['p10_s'] * 1e3:.3f}, "
                         f"p90 {last['p90_s'] * 1e3:.3f}, n={last['runs']})"
                         + (f" flags: {', '.join(b['flags'])}" if b["flags"] else ""))
        metrics = bench_metrics(blocks)
        for c in self.goals.criteria:
            res = fb_goals.evaluate(c.name, c.expr, metrics)
            if not res["error"]:
                value = "" if res["value"] is None else f" (value {res['value']:.4g})"
                lines.append(f"criterion {c.name!r}: {c.expr}{value} -> {'holds' if res['passed'] else 'NOT MET'}")
        return "\n".join(lines)

    def gil_probe(self, names: list[str] | None = None, candidate: str | None = None) -> str:
        run = self._run(candidate, ["gil"], benchmarks=self._bench_names(names), repeats=3)
        gil = run.result["gil"]
        texts = [f"[{name}] {r['text']}" for name, r in gil["reports"].items()]
        return "\n".join(texts) + f"\nruntime events: {gil['events']}"

    def trace(self, benchmark: str, candidate: str | None = None) -> str:
        run = self._run(candidate, ["trace"], benchmark=benchmark, steps=3)
        return run.result["trace"]["text"] + f"\nChrome trace: {run.result['trace']['path']}"

    def summarize_events(self, path: str, candidate: str | None = None) -> str:
        from flashinfra.feedback import events_summary

        target = Path(path)
        runs = self.runner.workdir.resolve()
        if target.is_absolute() and runs in target.resolve().parents and target.resolve().is_file():
            target = target.resolve()
        else:
            target = confine(self.tree_of(candidate), path, must_exist=True)
        return events_summary.format_text(events_summary.summarize(target))

    def ab_test(self, candidate: str, names: list[str] | None = None) -> str:
        names = self._bench_names(names)
        blocks = {"A": {}, "B": {}}
        for r in range(max(self.goals.rounds, 2)):
            for side in ("B", "A") if r % 2 == 0 else ("A", "B"):
                tree = self.tree_of(candidate) if side == "B" else self.base_tree
                run = self.runner.run(tree, ["bench"], benchmarks=names, repeats=self.goals.repeats, blocks=BLOCKS)
                if run.failure:
                    raise ToolError(f"{'candidate' if side == 'B' else 'baseline'} run failed: {run.failure}")
                for name, b in run.result["bench"].items():
                    blocks[side].setdefault(name, []).append(b["block_medians"])
        lines = []
        for name in blocks["A"]:
            res = stats.compare_blocks(blocks["A"][name], blocks["B"][name], "lower", self.goals.min_effect)
            lines.append(f"{name}: {res.summary()}".replace("better", "faster").replace("worse", "slower"))
        return "\n".join(lines)


class CampaignTools(FeedbackTools):
    """The feedback tools plus candidate management, bound to one ``Campaign``."""

    specs = {**FEEDBACK_SPECS, **CAMPAIGN_SPECS}

    def __init__(self, campaign):
        self.campaign = campaign
        super().__init__(campaign.goals, campaign.runner, campaign.tree, campaign.base_tree)
        self.finished_summary: str | None = None

    def _editable(self, cid: str, path: str) -> Path:
        c = self.campaign.candidate(cid, editable=True)
        tree = Path(c.tree)
        target = confine(tree, path)
        rel = target.relative_to(tree.resolve()).as_posix()
        why = self.campaign.gate.guardrails.why_not_editable(rel)
        if why:
            self.campaign.journal.write("edit", candidate=cid, path=rel, ok=False, reason=why)
            raise PermissionError(f"refused: {why}")
        return target

    def _edited(self, cid: str, rel: str) -> None:
        self.campaign.candidates[cid].edits.append(rel)
        self.campaign.journal.write("edit", candidate=cid, path=rel, ok=True)

    def new_candidate(self, hypothesis: str) -> str:
        c = self.campaign.new_candidate(hypothesis)
        return f"candidate {c.id} created at the base revision (branch {c.branch})"

    def edit_file(self, candidate: str, path: str, old_text: str, new_text: str) -> str:
        target = self._editable(candidate, path)
        if not target.is_file():
            raise ToolError(f"{path} does not exist; use write_file to create it")
        text = target.read_text(encoding="utf-8")
        count = text.count(old_text) if old_text else 0
        if count != 1:
            raise ToolError(f"old_text occurs {count} times in {path}; it must occur exactly once")
        target.write_text(text.replace(old_text, new_text), encoding="utf-8")
        self._edited(candidate, path)
        return f"edited {path} in {candidate}"

    def write_file(self, candidate: str, path: str, content: str) -> str:
        target = self._editable(candidate, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        self._edited(candidate, path)
        return f"wrote {path} in {candidate} ({len(content)} characters)"

    def apply_patch(self, candidate: str, patch: str) -> str:
        tree = Path(self.campaign.candidate(candidate, editable=True).tree)
        if re.search(r"^(new file mode|new mode|old mode) 120000", patch, re.M):
            raise PermissionError("refused: the patch creates a symlink")
        if not patch.endswith("\n"):
            patch += "\n"
        # Judge every path the patch touches before anything is applied (numstat only parses).
        proc = subprocess.run(["git", "apply", "--numstat", "-z", "-"], cwd=tree, input=patch.encode(),
                              capture_output=True)
        if proc.returncode != 0:
            raise ToolError(f"malformed patch: {proc.stderr.decode(errors='replace').strip()}")
        # -z numstat: "added\tdeleted\tpath" per file; a rename is "added\tdeleted\t", then source, target.
        fields = proc.stdout.decode().split("\0")
        paths = [p for p in (f.split("\t")[-1] for f in fields) if p]
        if not paths:
            raise ToolError("the patch changes no file")
        for path in paths:
            self._editable(candidate, path)
        proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=tree, input=patch.encode(),
                              capture_output=True)
        if proc.returncode != 0:
            raise ToolError(f"patch does not apply: {proc.stderr.decode(errors='replace').strip()}")
        for path in paths:
            self._edited(candidate, path)
        return f"applied patch to {', '.join(paths)} in {candidate}"

    def show_diff(self, candidate: str) -> str:
        tree = Path(self.campaign.candidate(candidate).tree)
        return worktree.diff(tree, self.campaign.base_sha) or "(no change)"

    def submit_candidate(self, candidate: str, summary: str = "") -> str:
        c = self.campaign.submit(candidate, summary)
        v = c.verdict
        lines = [f"candidate {c.id}: {'PASSED (waits for human approval)' if v['passed'] else 'REJECTED'}"]
        lines += [f"- {r}" for r in v["reasons"]]
        lines += [f"- target {t['metric']}: {t.get('summary') or t['verdict']}" for t in v["targets"]]
        lines += [f"- criterion {x['name']!r}: value {x['value']} -> {'holds' if x['passed'] else 'fails'}"
                  for x in v["criteria"]]
        return "\n".join(lines)

    def finish(self, summary: str) -> str:
        self.finished_summary = summary
        return "campaign finished"


def result_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
