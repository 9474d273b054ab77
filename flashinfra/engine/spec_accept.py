"""Acceptance of draft tokens against the target's distributions at the k + 1 verified positions.

- Greedy (``temperature == 0``): the longest prefix of drafts equal to the target's argmax, then the
  target's argmax after it (so the output is exactly what decoding without drafts gives).
- Otherwise rejection sampling (Leviathan et al. / Chen et al.): draft ``d_j`` drawn from ``q_j`` is kept with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from the
  normalised residual ``max(0, p_j - q_j)``; when all drafts are kept a bonus token is drawn from
  ``p_k``. Each emitted token is then distributed exactly as the target's ``p`` (the output distribution is
  unchanged). ``p_j`` are the target's probabilities after temperature / top-k / top-p / min-p
  (``truncated_probs``); ``q_j`` is one-hot for greedy (argmax) drafts. All random numbers come from the
  request's own generator, so a seeded request is reproducible in any batch.
"""

from __future__ import annotations

import torch


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """target_tokens: argmax at the k + 1 positions; -> the emitted tokens (1 .. k + 1)."""
    out = []
    for j, d in enumerate(draft_tokens):
        out.append(target_tokens[j])
        if d != target_tokens[j]:
            return out
    out.append(target_tokens[len(draft_tokens)])
    return out


def rejection_accept(target_probs: torch.Tensor, draft_tokens: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> list[int]:
    """target_probs [k + 1, V] (float), draft_probs [k, V] or None (one-hot drafts) -> emitted tokens."""
    k = len(draft_tokens)
    p = target_probs.double()
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        if q_d > 0 and float(u) * q_d < float(p[j, d]):
            out.append(d)
            continue
        q = torch.zeros_like(p[j]) if draft_probs is None else draft_probs[j].double()
        if draft_probs is None:
            q[d] = 1.0
        resid = (p[j] - q).clamp(min=0)
        total = resid.sum()
        resid = p[j] if float(total) <= 0 else resid / total
        out.append(int(torch.multinomial(resid.float(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k].float(), 1, generator=generator)))
    return out
