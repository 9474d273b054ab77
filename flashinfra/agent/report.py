"""The readable Markdown report of a campaign, rendered from its journal alone (so it can be rebuilt
after a crash or by ``flashinfra agent review``): goals, budgets spent, each candidate with its
hypothesis, verdict, reasons, measurements and decision, runs the sandbox stopped, and the tool calls.
"""

from __future__ import annotations

from collections import Counter

from flashinfra.agent import journal as journal_mod


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def verdict_lines(verdict: dict) -> list[str]:
    """The gate's reasons, target results and criteria, one line each (shared by report and review)."""
    lines = list(verdict.get("reasons", []))
    lines += [f"target {t['metric']}: {t.get('summary') or t['verdict']}" for t in verdict.get("targets", [])]
    lines += [f"criterion {c['name']!r} {c['expr']}: value {_fmt(c['value'])}, {'holds' if c['passed'] else 'fails'}"
              for c in verdict.get("criteria", [])]
    return lines


def render(records: list[dict]) -> str:
    start = next((r for r in records if r["kind"] == "campaign_start"), None)
    if start is None:
        return "# Infra Agent campaign\n\n(empty journal)\n"
    lines = [f"# Infra Agent campaign `{start['name']}`", "", f"Repository `{start['repo']}`, base "
             f"`{start['base'][:12]}`, goals file `{start['goals_file']}`.", "",
             f"Sandbox: {start.get('limits')}; network: {start.get('network_isolation')}.", "", "## Goals", "",
             "```", start["goals"], "```", ""]
    calls = [r for r in records if r["kind"] == "llm_call"]
    if calls:
        last = calls[-1]
        lines += [f"Model turns: {last['turn']}, tokens: {last['tokens_total']}, "
                  f"elapsed: {last['elapsed_s']:.0f} s.", ""]
    hypotheses = {r["candidate"]: r["text"] for r in records if r["kind"] == "hypothesis"}
    verdicts = {r["candidate"]: r for r in records if r["kind"] == "verdict"}
    decisions = {r["candidate"]: r for r in records if r["kind"] == "decision"}
    refused = [r for r in records if r["kind"] == "edit" and not r["ok"]]
    lines += ["## Candidates", ""]
    if not hypotheses:
        lines += ["(none)", ""]
    for cid, hypothesis in hypotheses.items():
        v = verdicts.get(cid)
        status = "open" if v is None else ("passed" if v["verdict"]["passed"] else "rejected by the gate")
        if cid in decisions:
            status += f"; {decisions[cid]['decision']} by a person"
            if decisions[cid].get("reason"):
                status += f": {decisions[cid]['reason']}"
        lines += [f"### {cid}: {status}", "", f"Hypothesis: {hypothesis}", ""]
        if v is None:
            continue
        verdict = v["verdict"]
        if v.get("summary"):
            lines += [f"Summary: {v['summary']}", ""]
        lines += [f"Changed: {', '.join(f'`{p}`' for p in verdict['changed']) or '(nothing)'}", ""]
        lines += [f"- {line}" for line in verdict_lines(verdict)]
        lines.append("")
    if refused:
        lines += ["## Refused edits", ""] + [f"- {r['candidate']}: {r['reason']}" for r in refused] + [""]
    stopped = [r for r in records if r["kind"] == "measurement" and (r.get("violations") or r.get("timed_out"))]
    if stopped:
        lines += ["## Runs stopped by the sandbox", ""]
        for r in stopped:
            what = "; ".join(f"{v['kind']}: {v['detail']}" for v in r.get("violations", [])) or "timeout"
            lines.append(f"- {r['side']} run in `{r['dir']}`: {what}")
        lines.append("")
    tools = Counter(r["name"] for r in records if r["kind"] == "tool_call")
    if tools:
        lines += ["## Tool calls", "", ", ".join(f"{name} x{n}" for name, n in tools.most_common()), ""]
    end = next((r for r in records if r["kind"] == "campaign_end"), None)
    if end:
        lines += ["## End", "", f"Stopped: {end['reason']}."] + ([f"\n{end['summary']}"] if end.get("summary") else [])
        lines.append("")
    return "\n".join(lines)


def write(campaign) -> None:
    (campaign.dir / "report.md").write_text(render(list(journal_mod.read(campaign.journal.path))),
                                            encoding="utf-8")
