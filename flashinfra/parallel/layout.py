"""``ParallelLayout``: which heads, experts and vocabulary rows one rank owns.

Pure data, no torch. The world is ``tp`` ranks; expert parallelism reuses those ranks (``ep`` is 1 or
``tp``): with ``ep == tp`` every rank holds whole experts (``E / ep`` of them), with ``ep == 1`` every
rank holds a ``1 / tp`` slice of every expert's intermediate dimension. Either way the hidden states are
replicated on every rank, so MoE dispatch costs nothing and combine is the one all-reduce that the
shared expert needs anyway (see ``shard.py``).

A world size that does not divide a sharded dimension is refused here, with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashinfra.config import TextConfig


class LayoutError(ValueError):
    """A parallel configuration that cannot shard this model; the message gives the numbers."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    ep: int
    rank: int

    @property
    def world(self) -> int:
        return self.tp

    def rows(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` (already checked to divide evenly)."""
        n = total // self.tp
        return slice(self.rank * n, (self.rank + 1) * n)

    def experts(self, E: int) -> slice:
        if self.ep == 1:
            return slice(0, E)
        n = E // self.ep
        return slice(self.rank * n, (self.rank + 1) * n)

    def check(self, cfg: TextConfig) -> None:
        """Raise ``LayoutError`` naming every dimension that ``tp`` / ``ep`` do not divide."""
        if self.tp < 1 or not 0 <= self.rank < self.tp:
            raise LayoutError(f"tensor_parallel_size {self.tp} with rank {self.rank}: need tp >= 1, 0 <= rank < tp")
        if self.ep not in (1, self.tp):
            raise LayoutError(f"expert_parallel_size {self.ep} must be 1 or equal tensor_parallel_size {self.tp} "
                              "(experts are spread over the tensor-parallel ranks)")
        need = [("KDA heads (linear_num_heads)", cfg.linear_num_heads, self.tp),
                ("MLA heads (num_attention_heads)", cfg.num_attention_heads, self.tp),
                ("vocab_size", cfg.vocab_size, self.tp),
                ("dense intermediate_size", cfg.intermediate_size, self.tp),
                ("shared expert width (moe_intermediate_size * n_shared_experts)",
                 cfg.moe_intermediate_size * cfg.n_shared_experts, self.tp)]
        if self.ep > 1:
            need.append(("routed experts (n_routed_experts)", cfg.n_routed_experts, self.ep))
        else:
            need.append(("expert intermediate size (moe_intermediate_size)", cfg.moe_intermediate_size, self.tp))
        bad = [f"{what} = {n} is not divisible by {by}" for what, n, by in need if n % by]
        if bad:
            raise LayoutError(f"cannot shard over tensor_parallel_size={self.tp}, expert_parallel_size={self.ep}: "
                              + "; ".join(bad))


def make_layout(cfg: TextConfig, tp: int, ep: int, rank: int) -> ParallelLayout:
    layout = ParallelLayout(tp, ep, rank)
    layout.check(cfg)
    return layout
