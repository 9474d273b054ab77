"""``flashinfra agent run | review | approve | reject`` and ``flashinfra mcp``.

The endpoint (base URL, model, API key) comes from the flags or, when a flag is absent, from
``flashinfra.env.agent_endpoint()``. The key is accepted from the environment (or ``--api-key-file``)
rather than a flag, so it never shows in a process list or a shell history.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _campaign_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--goals", required=True, help="the campaign's goals file (TOML)")
    p.add_argument("--repo", default=None, help="repository root (default: the goals file's repository)")
    p.add_argument("--campaign-dir", default=None, help="where the journal, report and worktrees live "
                   "(default: <repo>/.flashinfra-agent/<name>)")


def register(subparsers) -> None:
    agent = subparsers.add_parser("agent", help="the Infra Agent: goal-driven optimization with approval")
    sub = agent.add_subparsers(dest="agent_command", required=True)
    run = sub.add_parser("run", help="run (or resume) a campaign")
    _campaign_args(run)
    run.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint, e.g. http://host/v1")
    run.add_argument("--model", default=None, help="model name at --base-url (default: FLASHINFRA_AGENT_MODEL)")
    run.add_argument("--api-key-file", default=None, help="file holding the API key (else the environment)")
    run.set_defaults(func=_run)
    review = sub.add_parser("review", help="show passed candidates with diff and evidence")
    _campaign_args(review)
    review.add_argument("candidate", nargs="?")
    review.set_defaults(func=_review)
    approve = sub.add_parser("approve", help="merge a passed candidate")
    _campaign_args(approve)
    approve.add_argument("candidate")
    approve.set_defaults(func=_approve)
    reject = sub.add_parser("reject", help="record that a candidate will not land, and why")
    _campaign_args(reject)
    reject.add_argument("candidate")
    reject.add_argument("--reason", required=True, help="why it will not land (kept with the campaign)")
    reject.set_defaults(func=_reject)
    mcp = subparsers.add_parser("mcp", help="MCP server (stdio) exposing the feedback tools")
    mcp.add_argument("--repo", default=".", help="repository to serve (default: the current directory)")
    mcp.add_argument("--goals", default=None, help="goals file naming providers, benchmarks and limits")
    mcp.set_defaults(func=_mcp)


def _open(args, must_exist: bool, secrets: tuple[str, ...] = ()):
    from flashinfra.agent.campaign import Campaign

    return Campaign.open(args.goals, repo=args.repo, directory=args.campaign_dir, secrets=secrets,
                         must_exist=must_exist)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _run(args) -> int:
    from flashinfra import env
    from flashinfra.agent.campaign_goals import GoalsError
    from flashinfra.agent.chat_client import ChatClient, LLMError
    from flashinfra.agent.loop import Loop

    base_url, model, key = env.agent_endpoint()
    base_url, model = args.base_url or base_url, args.model or model
    if args.api_key_file:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
    try:
        client = ChatClient(base_url, model, key)
        campaign = _open(args, must_exist=False, secrets=(key,) if key else ())
    except (GoalsError, LLMError, FileNotFoundError, RuntimeError) as exc:
        return _fail(str(exc))
    try:
        reason = Loop(campaign, client).run()
    finally:
        client.close()
    passed = [c.id for c in campaign.candidates.values() if c.status == "passed"]
    print(f"campaign {campaign.goals.name}: {reason}")
    print(f"report: {campaign.dir / 'report.md'}")
    if passed:
        print(f"waiting for approval: {', '.join(passed)} (flashinfra agent review --goals {args.goals})")
    return 1 if reason.startswith("endpoint error") else 0


def _review(args) -> int:
    from flashinfra.agent import review

    try:
        print(review.review_text(_open(args, must_exist=True), args.candidate))
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as exc:
        return _fail(str(exc))
    return 0


def _approve(args) -> int:
    from flashinfra.agent import review

    try:
        head = review.approve(_open(args, must_exist=True), args.candidate)
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as exc:
        return _fail(str(exc))
    print(f"merged {args.candidate}: {head}")
    return 0


def _reject(args) -> int:
    from flashinfra.agent import review

    try:
        review.reject(_open(args, must_exist=True), args.candidate, args.reason)
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as exc:
        return _fail(str(exc))
    print(f"rejected {args.candidate}")
    return 0


def _mcp(args) -> int:
    from flashinfra.agent import mcp_server

    return mcp_server.main(Path(args.repo), Path(args.goals) if args.goals else None)
