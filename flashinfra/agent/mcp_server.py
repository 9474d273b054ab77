"""``flashinfra mcp``: the feedback tools over the Model Context Protocol (official ``mcp`` SDK, stdio), so
an external coding agent measures its own edits the way the Infra Agent does.

The served tree is the repository's working tree (uncommitted edits included); ``ab_test`` compares it
with a revision (default ``HEAD``) checked out in a worktree of its own. Every run of repository code goes
through the same sandbox as the Infra Agent's candidates. A goals file, when given, supplies the provider
modules, the default checks and benchmarks, the acceptance criteria and the sandbox limits; without one,
flashinfra's own providers are used.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from flashinfra.agent import worktree
from flashinfra.agent.campaign import STATE_DIR, campaign_dir
from flashinfra.agent.evaluate import Runner
from flashinfra.agent.campaign_goals import Goals, load_goals
from flashinfra.agent.tools import FEEDBACK_SPECS, FeedbackTools, ToolError
from flashinfra.agent.worktree import GitError


def default_goals(repo: Path) -> Goals:
    from flashinfra.feedback.registry import PROVIDERS

    return Goals(path=repo / "(no goals file)", name="mcp", goal="", base="HEAD", providers=PROVIDERS, checks=(),
                 benchmarks=(), rounds=2, repeats=5, min_effect=0.03, targets=(), criteria=(), editable=("**",),
                 read_only=())


def build_tools(repo: Path, goals_path: Path | None) -> FeedbackTools:
    repo = worktree.toplevel(repo)
    goals = load_goals(goals_path) if goals_path else default_goals(repo)
    state = campaign_dir(repo, "mcp")
    runner = Runner(goals, state / "runs")
    bases: dict[str, Path] = {}

    def tree_of(name: str | None) -> Path:
        if not name or name == "working":
            return repo
        raise KeyError("the MCP server serves the working tree only; use ab_test's base to name a revision")

    tools = FeedbackTools(goals, runner, tree_of, repo)

    def base_tree(rev: str) -> Path:
        sha = worktree.rev_parse(repo, rev)
        if sha not in bases:
            bases[sha] = worktree.ensure_worktree(repo, state / "bases" / sha[:12], sha)
        return bases[sha]

    tools.base_tree_for = base_tree
    return tools


def build_server(repo: Path, goals_path: Path | None = None):
    try:
        from mcp.server.mcpserver import MCPServer
        from mcp.server.mcpserver.exceptions import ToolError as MCPToolError
    except ModuleNotFoundError as exc:
        raise RuntimeError("flashinfra mcp needs the MCP SDK: pip install 'flashinfra[agent]'") from exc
    tools = build_tools(repo, goals_path)
    server = MCPServer("flashinfra-feedback", instructions=(
        "Dense feedback for this repository: correctness checks against float64 references, benchmarks "
        "with acceptance criteria, the GIL probe, runtime-event summaries and A/B experiments with a noise "
        f"floor. Repository code runs sandboxed. State lives in {STATE_DIR}/mcp."))
    doc = {name: spec["description"] for name, spec in FEEDBACK_SPECS.items()}

    def list_files(path: str = ".") -> str:
        return tools.list_files(path)

    def read_file(path: str, start_line: int = 1, max_lines: int = 400) -> str:
        return tools.read_file(path, start_line=start_line, max_lines=max_lines)

    def search_code(pattern: str, path: str = ".") -> str:
        return tools.search_code(pattern, path)

    def run_checks(patterns: list[str] | None = None) -> str:
        return tools.run_checks(patterns)

    def run_benchmarks(names: list[str] | None = None) -> str:
        return tools.run_benchmarks(names)

    def gil_probe(names: list[str] | None = None) -> str:
        return tools.gil_probe(names)

    def trace(benchmark: str) -> str:
        return tools.trace(benchmark)

    def summarize_events(path: str) -> str:
        return tools.summarize_events(path)

    def ab_test(names: list[str] | None = None, base: str = "HEAD") -> str:
        tools.base_tree = tools.base_tree_for(base)
        return tools.ab_test(candidate="working", names=names)

    for fn in (list_files, read_file, search_code, run_checks, run_benchmarks, gil_probe, trace, summarize_events,
               ab_test):
        description = doc[fn.__name__]
        if fn is ab_test:
            description = "A/B experiment: the working tree (B) against a revision (A, default HEAD), " \
                          "interleaved subprocess rounds, noise floor and verdict per benchmark."
        server.add_tool(_answering(fn, MCPToolError), name=fn.__name__, description=description)
    return server


def _answering(fn, error_type):
    """``fn`` with the errors a caller can act on (a path refused, a run stopped, a bad pattern) passed to
    the client as tool errors with their message, instead of the SDK's generic crash report."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ToolError, PermissionError, KeyError, ValueError, FileNotFoundError, GitError) as exc:
            raise error_type(str(exc.args[0] if exc.args else exc)) from exc

    return call


def main(repo: Path, goals_path: Path | None = None) -> int:
    try:
        server = build_server(repo, goals_path)
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server.run("stdio")
    return 0
