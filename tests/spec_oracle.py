"""Drafts planted in place of the MTP layer's: a known greedy continuation with every fifth token wrong, so rows
accept 0 to k drafts, through the engine's own path for drafts (kept on the device for the next step's inputs, read
back for its acceptance); the MTP layer's own drafts recorded before they are replaced."""

from __future__ import annotations

import torch


def plant_drafts(llm, want: dict | None, vocab: int) -> dict:
    """Wrap ``llm``'s engine so that after each step every request's drafts for its next step are recorded by
    (prompt, tokens emitted so far) and, given ``want`` (prompt tuple -> its whole greedy output), replaced by the next
    tokens of that output, those at output positions 4, 9, .. replaced by the next id modulo ``vocab`` (a row near its
    end keeps its own past the output's end); -> the dict the MTP layer's drafts go to."""
    core, spec = llm.engine, llm.engine.runner.speculator
    real_schedule, real_finish = core.scheduler.schedule, core._finish
    prompts, emitted, drafts = {}, {}, {}

    def schedule(*a, **kw):
        plan = real_schedule(*a, **kw)
        if plan is not None:
            prompts.update((sr.request_id, tuple(sr.prompt_token_ids)) for sr in plan.scheduled)
        return plan

    def finish(plan, handle):  # the engine's: the runner's own finish also runs inside a speculative step
        result = real_finish(plan, handle)
        for rid, toks in result.emitted.items():
            emitted.setdefault(rid, []).extend(toks)
        for rid, tok in result.sampled.items():
            if rid not in result.emitted:
                emitted.setdefault(rid, []).append(tok)
        if spec._pending is None:
            return result
        out, host, copied, _ = spec._pending
        if copied is not None:
            copied.synchronize()  # the host copy is written once, before it is changed here
        with torch.inference_mode():
            for rid, (col, n) in spec._columns.items():
                done = len(emitted.get(rid, []))
                drafts[(prompts[rid], done)] = host[:n, col].tolist()
                if want is not None:
                    d = [t if (done + j) % 5 != 4 else (t + 1) % vocab
                         for j, t in enumerate(want[prompts[rid]][done : done + n])]
                    for t in {out, host}:
                        t[: len(d), col] = torch.tensor(d, dtype=t.dtype)
        return result

    core.scheduler.schedule, core._finish = schedule, finish
    return drafts
