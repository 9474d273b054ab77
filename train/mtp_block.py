"""The MTP (NextN) block as a trainable module, unrolled over a draft's chained steps as the engine runs them.

Owns: ``MTPTrainBlock`` (transformers' own MLA/DSA attention and MoE modules, initialised from the target's last
attention layer, plus ``enorm``, ``hnorm``, ``eh_proj`` and the norms; no mHC) and its unrolled forward ``chain``,
whose attention and DSA selection reproduce what the engine's MTP cache holds at each step of a draft. Leaves the
loss, the data and the checkpoint files to ``train_mtp.py``.

What the engine computes (``flashinfra/engine/speculative.py``, ``flashinfra/model/mtp.py``): when a request's
committed tokens end at position ``i + 1``, the MTP layer's cache holds catch-up entries at positions ``0..i``,
entry ``p`` built from the target hidden ``h_p`` (stream mean, then final norm) and the token ``t_{p+1}``; the
last one's output hidden gives draft 1 (through ``shared_head.norm`` and the target's head). Draft ``s > 1``
comes from one more entry, at position ``i + s - 1``, whose input is ``eh_proj(enorm(embed(draft s-1)) ‖
hnorm(o))`` with ``o`` the previous entry's output hidden *before* ``shared_head.norm``; its query sees the
catch-up entries and the chained entries of the same draft before it. The next catch-up overwrites the chained
entries, so no query ever sees another draft's.

``chain`` runs that for every base position ``i`` of a window at once. Step 1 is the catch-up: causal over the
window. Step ``s`` feeds step ``s - 1``'s output hidden at ``i`` and the window's token at ``i + s``; its query
sees step 1's entries ``0..i`` and steps ``2..s``'s entries at the same base (virtual positions ``i + 1..i + s -
1``). The DSA selection is the engine's (``flashinfra.model.indexer``): complete pools of ``kpool`` consecutive
virtual positions (the pools completed by chained entries compressed from catch-up and chained entries alike),
the best ``index_topk / kpool`` kept with ties to the more recent pool, the incomplete tail always kept. As in
transformers and the engine, the indexer's own weights get no gradient (its top-k is not differentiable).

Where it differs from the engine: the chained steps read the window's tokens where the engine feeds its drafts
(``train_mtp.py`` says why); the catch-up entries come from one causal pass where the engine writes them as tokens
commit (the same values up to rounding; ``tests/test_train_mtp.py`` holds every draft of a greedy run equal in
float32); a window has no context before its first token, and its pools start there rather than at the sequence's
start; and the gradient of each step flows back through the chained hiddens and step 1's keys, which the engine
never needs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


# the engine's definitions (flashinfra.kernels.dsa_pool_keys.compress_pools, flashinfra.model.indexer.top_pools),
# restated so that the training scripts run without flashinfra installed; tests/test_train_mtp.py holds them equal
def compress_pools(entries: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pools' entries [P, kpool, 2 Di] -> their keys [P, Di]: per channel a softmax over the pool's tokens of gate
    score + position bias weights their keys."""
    keys, gates = entries.split(entries.shape[-1] // 2, dim=-1)
    probs = torch.softmax(gates.float() + ape.float()[None], dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def top_pools(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` best pools per row, ties going to the higher (more recent) index."""
    P = scores.shape[-1]
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    return P - 1 - order


class MTPTrainBlock(nn.Module):
    def __init__(self, target):
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

        lm = target.model.language_model
        cfg = lm.config
        D, last = cfg.hidden_size, cfg.num_hidden_layers - 1

        def norm(init=None):
            n = Glm5NextTextRMSNorm(D, cfg.rms_norm_eps)
            if init is not None:
                n.weight.data.copy_(init)
            return n

        self.enorm, self.hnorm, self.input_norm, self.post_attn_norm = norm(), norm(), norm(), norm()
        self.head_norm = norm(lm.norm.weight.data)  # the target's head reads hiddens of its final norm's scale
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=cfg.initializer_range)
        source = lm.layers[last]  # the last attention layer: an indexed MLA layer with an MoE
        self.self_attn, self.mlp = copy.deepcopy(source.self_attn), copy.deepcopy(source.mlp)
        # the copies carry the frozen target's flags: every weight of the block trains (the router's correction bias
        # is a buffer, moved by the load balance, not by gradients)
        self.requires_grad_(True)
        self.template = last

    def chain(self, embed: nn.Embedding, x: torch.Tensor, h: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Tokens ``x`` [B, L + 1] and the target's hiddens ``h`` [B, >= L, D] -> per step ``s = 1..steps`` the
        block's output hidden (before ``head_norm``) [B, L - s + 1, D] at bases ``0..L - s``; step ``s`` at base
        ``i`` reads the token at ``i + s`` and predicts the one at ``i + s + 1``."""
        L = x.shape[1] - 1
        if not 1 <= steps <= L or L < self.self_attn.indexer.index_kpool:
            raise ValueError(f"chain: {steps} steps over a window of {L} positions")
        first: tuple | None = None  # step 1's keys, values and index entries, over the whole window
        chained: list[tuple] = []  # steps 2..s: keys, values and index entries per base
        hidden, outs = h[:, :L], []
        for s in range(1, steps + 1):
            Ls = L - s + 1
            e = self.enorm(embed(x[:, s : s + Ls]))
            x_in = self.eh_proj(torch.cat([e, self.hnorm(hidden[:, :Ls])], dim=-1))
            kv, attn = self._attend(self.input_norm(x_in), first, chained)
            if first is None:
                first = kv
            else:
                chained.append(kv)
            hidden = x_in + attn
            hidden = hidden + self.mlp(self.post_attn_norm(hidden))
            outs.append(hidden)
        return outs

    def _attend(self, xn: torch.Tensor, first: tuple | None, chained: list[tuple]):
        """One step's MLA over what its queries see (module docstring) -> (its keys, values and index entries,
        the attention output [B, Ls, D])."""
        a = self.self_attn
        B, Ls, _ = xn.shape
        q_resid = a.q_a_layernorm(a.q_a_proj(xn))
        q = a.q_b_proj(q_resid).view(B, Ls, a.num_heads, a.qk_head_dim).transpose(1, 2)  # [B, H, Ls, Dq]
        kv_pass, k_rot = a.kv_a_proj_with_mqa(xn).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k, v = a.expand_kv(a.kv_a_layernorm(kv_pass)[:, None], k_rot[:, None])  # [B, H, Ls, Dq], [B, H, Ls, Dv]
        with torch.no_grad():
            entries, iq, iw = self._index_inputs(xn, q_resid)
            own = (k, v, entries)
            base = own if first is None else first
            chained_entries = [c[2] for c in chained] + ([] if first is None else [entries])
            sees_base, sees_chained = self._select(base[2], chained_entries, iq, iw)
        scores = torch.matmul(q, base[0][:, :, :Ls].transpose(-1, -2)) * a.scaling  # [B, H, Ls, Ls]
        scores = scores.masked_fill(~sees_base[:, None], float("-inf"))
        if first is None:
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs, v)
        else:
            ck = torch.stack([c[0][:, :, :Ls] for c in chained] + [k], dim=3)  # [B, H, Ls, s - 1, Dq]
            cv = torch.stack([c[1][:, :, :Ls] for c in chained] + [v], dim=3)
            c_scores = (q[:, :, :, None] * ck).sum(-1) * a.scaling  # [B, H, Ls, s - 1]
            c_scores = c_scores.masked_fill(~sees_chained[:, None], float("-inf"))
            probs = torch.softmax(torch.cat([scores, c_scores], dim=-1).float(), dim=-1).to(q.dtype)
            out = torch.matmul(probs[..., :Ls], base[1][:, :, :Ls]) + (probs[..., Ls:, None] * cv).sum(3)
        out = a.o_proj(out.transpose(1, 2).reshape(B, Ls, -1))
        return own, out

    def _index_inputs(self, xn: torch.Tensor, q_resid: torch.Tensor):
        """-> the indexer's cache entries [B, Ls, 2 Di] (key | pool gate score), queries [B, Ls, Hi, Di] and head
        weights [B, Ls, Hi] float32."""
        ix = self.self_attn.indexer
        B, Ls, _ = xn.shape
        entries = torch.cat([ix.k_norm(ix.wk(xn)), F.linear(xn, ix.index_kpool_compress_gate)], dim=-1)
        q = ix.wq_b(q_resid).view(B, Ls, ix.n_heads, ix.head_dim)
        return entries, q, ix.weights_proj(xn).float() * ix.n_heads**-0.5

    def _pool_scores(self, q: torch.Tensor, w: torch.Tensor, pool_keys: torch.Tensor) -> torch.Tensor:
        """q [B, Ls, Hi, Di], w [B, Ls, Hi], pool keys [B, P, Di] (shared) or [B, Ls, P, Di] -> [B, Ls, P]."""
        ix = self.self_attn.indexer
        keys = pool_keys.float().transpose(-1, -2)
        keys = keys[:, None] if keys.dim() == 3 else keys  # [B, 1 or Ls, Di, P]
        scores = F.relu(torch.matmul(q.float(), keys) * ix.head_dim**-0.5)  # [B, Ls, Hi, P]
        return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)

    def _select(self, base: torch.Tensor, chained: list[torch.Tensor], q: torch.Tensor, w: torch.Tensor):
        """The engine's DSA selection for a step with ``len(chained)`` chained entries per base: ``base`` [B, L, 2Di]
        step 1's entries, ``chained`` steps 2..s's [B, >= Ls, 2Di] -> what each query sees of step 1's entries
        [B, Ls, Ls] and of the chained ones [B, Ls, s - 1] (bool)."""
        ix = self.self_attn.indexer
        kp, Di, dev = ix.index_kpool, ix.head_dim, q.device
        B, Ls, n_c = q.shape[0], q.shape[1], len(chained)
        M = base.shape[1] // kp
        i = torch.arange(Ls, device=dev)
        c = (i + 1) // kp  # complete pools of step-1 entries at base i
        r = (i + 1) % kp  # step-1 entries past them: the start of the base's own region
        # the region: step 1's entries c*kp..i, then the chained ones; its complete pools hold chained entries
        R = kp - 1 + n_c
        t = torch.arange(R, device=dev)
        from_base = (c[:, None] * kp + t[None, : kp - 1]).clamp(max=base.shape[1] - 1)  # [Ls, kp - 1]
        parts = [base[:, from_base]] + ([torch.stack([e[:, :Ls] for e in chained], dim=2)] if n_c else [])
        region = torch.cat(parts, dim=2)  # [B, Ls, R, 2Di]: step 1's candidates, then the chained entries
        src = torch.where(t[None] < r[:, None], t[None], kp - 1 + t[None] - r[:, None]).clamp(max=R - 1)
        region = region.gather(2, src[None, :, :, None].expand(B, Ls, R, 2 * Di))
        n = r + n_c  # region length per base
        E = R // kp
        base_keys = compress_pools(base[:, : M * kp].reshape(B * M, kp, 2 * Di), ix.index_kpool_compress_ape)
        scores = [self._pool_scores(q, w, base_keys.view(B, M, Di))]
        valid = [torch.arange(M, device=dev)[None] < c[:, None]]  # [Ls, M]
        if E:
            keys = compress_pools(region[:, :, : E * kp].reshape(B * Ls * E, kp, 2 * Di), ix.index_kpool_compress_ape)
            scores.append(self._pool_scores(q, w, keys.view(B, Ls, E, Di)))
            valid.append(torch.arange(E, device=dev)[None] < (n // kp)[:, None])
        scores, valid = torch.cat(scores, dim=-1), torch.cat(valid, dim=-1)  # pools in position order
        scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
        chosen = top_pools(scores, min(ix.index_topk // kp, scores.shape[-1]))
        picked = torch.zeros_like(scores, dtype=torch.bool)
        picked.scatter_(-1, chosen, valid.expand_as(scores).gather(-1, chosen))
        base_pool, region_pool = picked[..., :M], picked[..., M:]  # [B, Ls, M], [B, Ls, E]
        pool_of_t = (t // kp).clamp(max=max(E - 1, 0))
        sees_region = (t[None] < n[:, None]) & (region_pool[..., pool_of_t] if E else False)
        if ix.index_kpool_always_select_tail and kp > 1:
            sees_region = sees_region | ((t[None] >= (n - n % kp)[:, None]) & (t[None] < n[:, None]))
        sees_region = sees_region.expand(B, Ls, R) if sees_region.dim() == 2 else sees_region
        pos = torch.arange(Ls, device=dev)
        in_pools = pos[None] < (c * kp)[:, None]  # [Ls, Ls]
        in_region = (pos[None] >= (c * kp)[:, None]) & (pos[None] <= i[:, None])
        from_pool = base_pool.gather(-1, (pos // kp).clamp(max=M - 1)[None, None].expand(B, Ls, Ls))
        t_of_pos = (pos[None] - (c * kp)[:, None]).clamp(0, R - 1)  # [Ls, Ls]
        from_region = sees_region.gather(-1, t_of_pos[None].expand(B, Ls, Ls))
        sees_base = (in_pools & from_pool) | (in_region & from_region)
        at = (r[:, None] + torch.arange(n_c, device=dev)[None]).clamp(max=R - 1)  # [Ls, s - 1]
        sees_chained = sees_region.gather(-1, at[None].expand(B, Ls, n_c))
        return sees_base, sees_chained
