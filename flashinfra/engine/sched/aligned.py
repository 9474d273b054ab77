"""Deterministic mode's prompt pieces: where a step may cut a request's prompt.

With ``EngineConfig.deterministic`` a prompt piece that stops short of the prompt's end stops
at a multiple of ``DETERMINISTIC_ALIGN`` tokens from the sequence start (the KDA prefill's chunk) and never leaves
a single prompt token behind, so the KDA recurrence meets the same chunk boundaries whatever the token budget
left to the request, and a 1-token piece on a cached state is always a generated token (decode arithmetic). A
piece never crosses the prompt's end: a request recomputed after a preemption runs its prompt in aligned pieces,
then its generated tokens one a step, each through the decode arithmetic it first ran through, so preemption
changes no bit either.

Pure Python; no torch.
"""

from __future__ import annotations

from flashinfra.engine.sched.request import Request

# the KDA prefill's chunk length for 16-bit activations (float32 takes 16-token chunks, which divide it): prefix
# checkpoints sit on its multiples in every mode (``HybridCacheManager``), deterministic mode's cuts too
KDA_CHUNK = 64
DETERMINISTIC_ALIGN = KDA_CHUNK


def aligned_piece(req: Request, start: int, n: int) -> int:
    """The tokens of a piece of at most ``n`` from ``start`` that meets the KDA recurrence as every other run of
    the request does."""
    prompt = req.num_prompt_tokens
    if start >= prompt:  # generated tokens (recomputed after a preemption): one a step, as they first ran
        return min(n, 1)
    end = min(start + n, prompt)
    if end < prompt:
        end -= (end - start) % DETERMINISTIC_ALIGN  # start is aligned: 0, a cached prefix or an earlier cut
        if prompt - end == 1:
            end = max(start, end - DETERMINISTIC_ALIGN)
    return end - start
