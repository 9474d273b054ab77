"""Drafts planted in place of the MTP layer's: a known greedy continuation with every fifth token wrong, so rows
accept 0 to k drafts and take the engine's own path for drafts (kept on the device, read back for the acceptance)."""

from __future__ import annotations

import torch


def plant_drafts(spec, sched, feeds, committed, nexts, continuation, k: int, vocab: int) -> None:
    """After ``spec.draft(sched, feeds, ..., committed, nexts)``: each row that goes on drafts the next ``k`` tokens of
    ``continuation[prompt]`` (its whole greedy output) after what it has emitted, those at output positions 4, 9, ..
    replaced by the next id modulo ``vocab``; a row near its end drafts fewer."""
    rows, columns = [], []
    for b, sr in enumerate(sched):
        if nexts[b] is None:
            continue
        out = list(sr.output_token_ids) + feeds[b][sr.num_new_tokens : committed[b]] + [nexts[b]]
        d = continuation[tuple(sr.prompt_token_ids)][len(out) : len(out) + k]
        if d:
            rows.append((sr.request_id, len(d) - 1))
            wrong = [t if (len(out) + j) % 5 != 4 else (t + 1) % vocab for j, t in enumerate(d)]
            columns.append(wrong + [0] * (k - len(d)))
    if rows:
        spec._read_back(torch.tensor(columns, dtype=torch.long, device=spec.device).T.contiguous(), rows)
