"""The campaign loop: the model proposes tool calls, the tools run them, everything is journaled, until
the model calls ``finish`` or a budget (turns, wall time, tokens) runs out.

Resuming: the conversation is rebuilt from the journal's ``message`` records, the budgets already spent
from its ``llm_call`` records. Tool calls of the last turn that have no result (the crash hit while they
ran) are answered with an "interrupted" result, so the model decides whether to call them again; nothing
is re-run behind its back.
"""

from __future__ import annotations

import time

from flashinfra.agent import report
from flashinfra.agent.campaign import Campaign
from flashinfra.agent.chat_client import ChatClient, LLMError, parse_arguments
from flashinfra.agent.paths import PathError
from flashinfra.agent.tools import CampaignTools, ToolError, openai_tools
from flashinfra.agent.worktree import GitError

MAX_TOOL_OUTPUT = 12_000

SYSTEM_PROMPT = """You are the Infra Agent: you find where speed or accuracy is lost in this repository and \
prove each fix with measurements. Work in steps:
1. Find the problem through the signals: run_checks (errors against float64 references, where the wrong \
elements are), run_benchmarks (timings and whether the acceptance criteria hold), gil_probe (threads \
starved by a call that holds the GIL, with stacks), summarize_events, and read_file/search_code.
2. State a hypothesis with new_candidate; each candidate is a separate git worktree of the base revision.
3. Change only editable paths (edit_file, write_file, apply_patch). Tests, checks, benchmarks and the \
goals file are read-only: the evidence must not change.
4. Measure the candidate (run_checks, run_benchmarks, ab_test with candidate=...), then submit_candidate. \
It passes only if every check passes, the acceptance criteria hold, and the targets improve beyond the \
noise floor. Nothing lands without a person's approval.
5. Call finish with a summary when a candidate passed or nothing more is worth trying.
Candidate code runs in a sandbox without network and without access outside the repository."""


def _estimate_tokens(messages: list[dict]) -> int:
    return sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in messages) // 4


class Loop:
    def __init__(self, campaign: Campaign, client: ChatClient):
        self.campaign, self.client = campaign, client
        self.tools = CampaignTools(campaign)
        self.journal = campaign.journal
        self.messages: list[dict] = []
        self.turns = self.tokens = 0
        self.elapsed_s = 0.0
        records = self.journal.records()
        for r in records:
            if r["kind"] == "message":
                self.messages.append(r["message"])
            elif r["kind"] == "llm_call":
                self.turns, self.tokens, self.elapsed_s = r["turn"], r["tokens_total"], r["elapsed_s"]
        if self.messages:
            self.journal.write("resume", turns=self.turns, tokens=self.tokens, elapsed_s=self.elapsed_s)
            self._answer_interrupted()
        else:
            self._say({"role": "system", "content": SYSTEM_PROMPT})
            self._say({"role": "user", "content": campaign.goals.describe()})

    def _say(self, message: dict) -> None:
        self.messages.append(message)
        self.journal.write("message", message=message)

    def _answer_interrupted(self) -> None:
        last = self.messages[-1] if self.messages else {}
        if last.get("role") == "assistant" or last.get("role") == "tool":
            # Find the last assistant turn and answer any of its calls that have no result yet.
            idx = max(i for i, m in enumerate(self.messages) if m.get("role") == "assistant")
            answered = {m.get("tool_call_id") for m in self.messages[idx + 1:] if m.get("role") == "tool"}
            for call in self.messages[idx].get("tool_calls") or []:
                if call["id"] not in answered:
                    self._say({"role": "tool", "tool_call_id": call["id"],
                               "content": "interrupted: the campaign stopped while this ran and was resumed; "
                                          "call it again if you still need it"})

    def _budget_left(self, start: float) -> str | None:
        b = self.campaign.goals.budgets
        if self.turns >= b.iterations:
            return f"iteration budget spent ({self.turns}/{b.iterations})"
        if self.tokens >= b.tokens:
            return f"token budget spent ({self.tokens}/{b.tokens})"
        if self.elapsed_s + time.monotonic() - start >= b.wall_time_s:
            return f"wall-time budget spent ({b.wall_time_s:g} s)"
        return None

    def run(self) -> str:
        """Run until finish or a budget; returns why it stopped. The report is rewritten as it goes."""
        if self.campaign.finished:
            return "campaign already finished"
        start = time.monotonic()
        idle = 0
        while True:
            spent = self._budget_left(start)
            if spent:
                return self._end(f"budget: {spent}")
            try:
                reply = self.client.complete(self.messages, openai_tools(self.tools.specs))
            except LLMError as exc:
                # Not the end of the campaign: the same command resumes it once the endpoint answers.
                self.journal.write("llm_error", error=str(exc))
                report.write(self.campaign)
                return f"endpoint error (resumable): {exc}"
            self.turns += 1
            self.tokens += reply.total_tokens or _estimate_tokens(self.messages[-2:] + [reply.message])
            self.journal.write("llm_call", turn=self.turns, prompt_tokens=reply.prompt_tokens,
                               completion_tokens=reply.completion_tokens, tokens_total=self.tokens,
                               latency_s=reply.latency_s, elapsed_s=self.elapsed_s + time.monotonic() - start)
            self._say(reply.message)
            calls = reply.message.get("tool_calls") or []
            if not calls:
                idle += 1
                if idle >= 2:
                    return self._end("the model stopped calling tools")
                self._say({"role": "user", "content": "Continue with the tools; call finish when done."})
                continue
            idle = 0
            for call in calls:
                self._call(call)
            report.write(self.campaign)
            if self.tools.finished_summary is not None:
                return self._end("finished", self.tools.finished_summary)

    def _call(self, call: dict) -> None:
        name = call["function"]["name"]
        try:
            args = parse_arguments(call)
        except ValueError as exc:
            args, output, ok = {}, f"error: malformed arguments: {exc}", False
        else:
            self.journal.write("tool_call", id=call["id"], name=name, arguments=args)
            t0 = time.monotonic()
            try:
                output, ok = self.tools.call(name, args), True
            except (ToolError, PermissionError, PathError, KeyError, ValueError, FileNotFoundError, GitError,
                    TypeError) as exc:
                output, ok = f"error: {exc.args[0] if exc.args else exc}", False
            self.journal.write("tool_result", id=call["id"], name=name, ok=ok, seconds=time.monotonic() - t0,
                               output=output)
        if len(output) > MAX_TOOL_OUTPUT:
            output = output[:MAX_TOOL_OUTPUT] + f"\n[... {len(output) - MAX_TOOL_OUTPUT} characters cut]"
        self._say({"role": "tool", "tool_call_id": call["id"], "content": output})

    def _end(self, reason: str, summary: str = "") -> str:
        self.campaign.end(reason, summary)
        report.write(self.campaign)
        return reason
