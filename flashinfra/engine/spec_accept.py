"""Acceptance of draft tokens against the target's distributions at the k + 1 verified positions.

- Greedy (``temperature == 0``): the longest prefix of drafts equal to the target's argmax, then the
  target's argmax after it (so the output is exactly what decoding without drafts gives).
- Otherwise rejection sampling (Leviathan et al. / Chen et al.): draft ``d_j`` drawn from ``q_j`` is kept with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from the
  normalised residual ``max(0, p_j - q_j)``; when all drafts are kept a bonus token is drawn from
  ``p_k``. Each emitted token is then distributed exactly as the target's ``p`` (the output distribution is
  unchanged). ``p_j`` are the target's probabilities after temperature / top-k / top-p / min-p
  (``truncated_probs``); ``q_j`` is one-hot for greedy (argmax) drafts.

``rejection_accept_rows`` runs it for many rows at once on the device: per position one uniform (the keep test) and
one draw from that position's residual (from ``p`` itself past the last draft) by the exponential race, all
positions together, then one read-back; the host only finds each row's first rejection. Each row's random numbers
come from its own generator where it has one (a seeded request, or any row in deterministic mode: its tokens do not
depend on the batch); the rows without one share one draw from ``shared``, a launch for all of them.
"""

from __future__ import annotations

import torch

from flashinfra.engine.sampler import draw_rows


def greedy_accept(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """target_tokens: argmax at the k + 1 positions; -> the emitted tokens (1 .. k + 1)."""
    out = []
    for j, d in enumerate(draft_tokens):
        out.append(target_tokens[j])
        if d != target_tokens[j]:
            return out
    out.append(target_tokens[len(draft_tokens)])
    return out


def rejection_accept_rows(probs: torch.Tensor, drafts: list[list[int]], generators: list[torch.Generator | None],
                          shared: torch.Generator | None = None,
                          draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """probs [N, V] (float): each row's ``len(drafts[r]) + 1`` positions in turn; draft_probs alike (its rows at the
    positions past the last draft unread) or None (one-hot drafts); one generator per row or None (then ``shared``)
    -> each row's emitted tokens."""
    N, V = probs.shape
    dev = probs.device
    sizes = [len(d) + 1 for d in drafts]
    if sum(sizes) != N or len(generators) != len(drafts):
        raise ValueError(f"rejection_accept_rows: {N} positions for drafts of {[len(d) for d in drafts]}, "
                         f"{len(generators)} generators")
    u = draw_rows(lambda t, g: t.uniform_(generator=g), torch.empty(N, dtype=torch.float64, device=dev), sizes,
                  generators, shared)
    noise = draw_rows(lambda t, g: t.exponential_(generator=g), torch.empty(N, V, dtype=torch.float32, device=dev),
                      sizes, generators, shared)
    draft_at = torch.tensor([t for d in drafts for t in d + [-1]], dtype=torch.long).to(dev, non_blocking=True)
    has = draft_at >= 0  # a draft at the position (not the bonus one)
    d = draft_at.clamp(min=0)[:, None]
    p = probs.double()
    if draft_probs is None:  # q one-hot at the draft: max(0, p - q) is p without the draft's token
        q_d = torch.ones(N, dtype=torch.float64, device=dev)
        resid = p.scatter(1, d, 0.0)
    else:
        q = draft_probs.double()
        q_d = q.gather(1, d).squeeze(1)
        resid = (p - q).clamp(min=0)
    keep = has & (q_d > 0) & (u * q_d < p.gather(1, d).squeeze(1))
    total = resid.sum(1, keepdim=True)
    resid = torch.where(has[:, None] & (total > 0), resid / total, p)  # the bonus position, or no residual: p
    token = torch.argmax(resid.float() / noise, dim=-1)
    keep, token = torch.stack([keep.long(), token]).cpu().tolist()  # one read-back
    out, at = [], 0
    for row in drafts:
        emitted = []
        for j, t in enumerate(row):
            if not keep[at + j]:
                emitted.append(token[at + j])
                break
            emitted.append(t)
        else:
            emitted.append(token[at + len(row)])
        out.append(emitted)
        at += len(row) + 1
    return out
