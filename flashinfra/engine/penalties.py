"""Repetition, frequency and presence penalties from token counts kept on the device.

The penalties of a row read every token of its request: repetition those of the prompt and the output, frequency
and presence the output's counts. Built from the host's token lists each step, that is a list walk per row and a
tensor as wide as the longest request per step, and it needs the last sampled token on the host, so a step with a
penalized row could not be scheduled before the previous one finished. Here a request with penalties owns one row
of two ``[rows, V]`` tensors while it runs:

- ``counts`` (int32): how often each token occurs in its output;
- ``prompt`` (bool): which tokens its prompt holds, written once, when the request first samples.

Each token sampled on the device is counted there right after it is drawn, on the same stream, so the next step
sees it before the host does (asynchronous scheduling). Tokens that reach the request otherwise (accepted drafts,
tokens sampled on the host for a row with a grammar) are counted from the host's list at the request's next
device-sampled step. The host keeps, per request, how many output tokens its row has counted; a step's sampled
row knows how many output tokens precede it (``context_len + num_new_tokens - prompt length``, placeholders of a
step in flight included), so the difference is what to add. A row that has counted more than that (a request whose
output was cut back) is rebuilt from the host's lists. A row is freed when its request finishes or is preempted.

The penalties themselves are one kernel (``flashinfra.kernels.penalties``), whose reference ``sampler.apply_penalties``
also uses for rows given as token lists (the speculative verify, grammar rows, the checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.engine.sched.plan import PLACEHOLDER_TOKEN
from flashinfra.kernels.penalties import penalize
from flashinfra.model.staging import Array

_FIRST_ROWS = 16  # rows allocated on the first penalized request; doubled when they run out


class PenaltyRows:
    """The device rows of the running requests with penalties, and what each has counted (see the module)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.free: list[int] = []
        self.held: dict[str, list[int]] = {}  # request id -> [row, output tokens counted]

    def release(self, request_ids) -> None:
        for rid in request_ids:
            held = self.held.pop(rid, None)
            if held is not None:
                self.free.append(held[0])

    def columns(self, sampled: list) -> list[Array]:
        """The step's penalty arrays for its sampled rows (``ScheduledRequest``s, in sampling order), to go in the
        step's packed copy: which rows are penalized and with what, the rows to rebuild, the prompt and output
        tokens to write first. Counts each penalized row's token of this step as written (``PenaltyStep.count``)."""
        index, rows, reset, prompt_at, prompt_tok, add_at, add_tok = [], [], [], [], [], [], []
        for i, sr in enumerate(sampled):
            if not sr.sampling.has_penalties:
                continue
            before = sr.context_len + sr.num_new_tokens - len(sr.prompt_token_ids)  # output tokens before this one
            held = self.held.get(sr.request_id)
            if held is None or held[1] > before:
                if held is None:
                    held = self.held[sr.request_id] = [self._take(), 0]
                reset.append(held[0])
                held[1] = 0
                prompt_at += [held[0]] * len(sr.prompt_token_ids)
                prompt_tok += sr.prompt_token_ids
            missing = sr.output_token_ids[held[1] : before]
            if len(missing) != before - held[1] or PLACEHOLDER_TOKEN in missing:
                raise RuntimeError(f"request {sr.request_id}: output tokens to count are not on the host")
            add_at += [held[0]] * len(missing)
            add_tok += missing
            held[1] = before + 1
            index.append(i)
            rows.append(held[0])
        if not index:
            return []
        i64, f32, n = torch.int64, torch.float32, (len(index), 1)
        params = [sampled[i].sampling for i in index]
        return [("pen_index", i64, index, (len(index),)), ("pen_rows", i64, rows, (len(rows),)),
                ("pen_rep", f32, [p.repetition_penalty for p in params], n),
                ("pen_freq", f32, [p.frequency_penalty for p in params], n),
                ("pen_pres", f32, [p.presence_penalty for p in params], n),
                ("pen_reset", i64, reset, (len(reset),)),
                ("pen_prompt_rows", i64, prompt_at, (len(prompt_at),)),
                ("pen_prompt_tokens", i64, prompt_tok, (len(prompt_tok),)),
                ("pen_add_rows", i64, add_at, (len(add_at),)), ("pen_add_tokens", i64, add_tok, (len(add_tok),))]

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count ``tokens`` [n] in ``rows`` [n] (repeats add up): one atomic scatter into the flat counts
        (``index_put_`` with ``accumulate`` sorts its indices first, which took longer than the rest of the
        penalties on the GPU)."""
        flat = rows * self.vocab_size + tokens
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def _take(self) -> int:
        if not self.free:
            old = self.counts.shape[0]
            new = max(_FIRST_ROWS, 2 * old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab_size)])
            self.free = list(range(new - 1, old - 1, -1))
        return self.free.pop()


@dataclass
class PenaltyStep:
    """One step's penalty inputs on the device: ``views``, the step's packed copy (``PenaltyRows.columns``)."""

    rows: PenaltyRows
    views: dict[str, torch.Tensor]

    @staticmethod
    def of(rows: PenaltyRows, views: dict[str, torch.Tensor]) -> "PenaltyStep | None":
        return PenaltyStep(rows, views) if "pen_index" in views else None

    def apply(self, x: torch.Tensor) -> None:
        """Bring the rows up to date (rebuilt rows, tokens counted from the host), then penalize ``x`` [N, V] in
        place."""
        v, state = self.views, self.rows
        if v["pen_reset"].numel():
            state.counts[v["pen_reset"]] = 0
            state.prompt[v["pen_reset"]] = False
        if v["pen_prompt_rows"].numel():
            state.prompt[v["pen_prompt_rows"], v["pen_prompt_tokens"]] = True
        if v["pen_add_rows"].numel():
            state.add(v["pen_add_rows"], v["pen_add_tokens"])
        penalize(x, v["pen_index"], v["pen_rows"], state.counts, state.prompt, v["pen_rep"], v["pen_freq"],
                 v["pen_pres"])

    def count(self, tokens: torch.Tensor) -> None:
        """Count the penalized rows' sampled ``tokens`` (the step's [N]) in their rows."""
        v = self.views
        self.rows.add(v["pen_rows"], tokens[v["pen_index"]])
