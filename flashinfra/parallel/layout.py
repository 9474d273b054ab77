"""``ParallelLayout``: which heads, experts and vocabulary rows one rank owns, and which ranks it reduces with.

Pure data, no torch. The world is ``max(tp, ep)`` ranks; the smaller of the two sizes divides it.

- Tensor-parallel groups: consecutive runs of ``tp`` ranks (``[0, tp)``, ``[tp, 2 tp)``, ...). Each group
  holds a whole copy of attention, dense MLPs, embedding and lm_head, split over its ``tp`` ranks. When
  ``tp < world`` the ``world / tp`` groups all compute the same tokens: attention is replicated across
  groups, not data-parallel. Data-parallel attention (each group its own requests, tokens moved to the
  experts by all-to-all, as in vLLM's and SGLang's DP attention) needs a scheduler per group and is not
  done here; the replicated form needs no token movement and is what ``tp < ep`` means in this engine.
- The MoE group, over which one MoE layer (routed experts and shared expert) is split and reduced once:
  with ``ep > 1`` the expert-parallel group (consecutive runs of ``ep`` ranks), each rank holding
  ``E / ep`` whole experts and a ``1 / ep`` slice of the shared expert; with ``ep == 1`` the
  tensor-parallel group, each rank holding a ``1 / tp`` slice of every expert's intermediate dimension.

Hidden states are replicated on every rank after every reduction, so MoE dispatch costs nothing and
combine is one all-reduce over the MoE group (see ``shard.py``).

A configuration that does not divide a sharded dimension, or whose sizes do not nest, is refused here,
with the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashinfra.config import TextConfig


class LayoutError(ValueError):
    """A parallel configuration that cannot shard this model; the message gives the numbers."""


def world_size(tp: int, ep: int) -> int:
    """Ranks a ``tp`` x ``ep`` configuration runs on."""
    return max(tp, ep)


def _group(rank: int, size: int) -> tuple[int, ...]:
    first = rank // size * size
    return tuple(range(first, first + size))


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    ep: int
    rank: int

    @property
    def world(self) -> int:
        return world_size(self.tp, self.ep)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def moe_size(self) -> int:
        """Ranks one MoE layer is split over (and reduced over)."""
        return self.ep if self.ep > 1 else self.tp

    @property
    def moe_rank(self) -> int:
        return self.rank % self.moe_size

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        return _group(self.rank, self.tp)

    @property
    def moe_ranks(self) -> tuple[int, ...]:
        return _group(self.rank, self.moe_size)

    def groups(self, size: int) -> list[tuple[int, ...]]:
        """Every group of ``size`` consecutive ranks of the world (each rank must create all of them)."""
        return [tuple(range(g, g + size)) for g in range(0, self.world, size)]

    def rows(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` within its tensor-parallel group."""
        n = total // self.tp
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    def moe_rows(self, total: int) -> slice:
        """This rank's contiguous share of ``total`` within its MoE group (shared expert; experts' width)."""
        n = total // self.moe_size
        return slice(self.moe_rank * n, (self.moe_rank + 1) * n)

    def experts(self, E: int) -> slice:
        """Routed experts this rank holds (all of them, sliced by width, when ``ep == 1``)."""
        return self.moe_rows(E) if self.ep > 1 else slice(0, E)

    def check(self, cfg: TextConfig) -> None:
        """Raise ``LayoutError`` naming every dimension that ``tp`` / ``ep`` do not divide."""
        if self.tp < 1 or self.ep < 1 or not 0 <= self.rank < self.world:
            raise LayoutError(f"tensor_parallel_size {self.tp}, expert_parallel_size {self.ep} with rank "
                              f"{self.rank}: need tp >= 1, ep >= 1, 0 <= rank < max(tp, ep)")
        if self.world % self.tp or self.world % self.ep:
            raise LayoutError(f"expert_parallel_size {self.ep} and tensor_parallel_size {self.tp}: the smaller "
                              f"must divide the larger (the world is max(tp, ep) = {self.world} ranks)")
        m = self.moe_size
        need = [("KDA heads (linear_num_heads)", cfg.linear_num_heads, self.tp),
                ("MLA heads (num_attention_heads)", cfg.num_attention_heads, self.tp),
                ("vocab_size", cfg.vocab_size, self.tp),
                ("dense intermediate_size", cfg.intermediate_size, self.tp),
                ("shared expert width (moe_intermediate_size * n_shared_experts)",
                 cfg.moe_intermediate_size * cfg.n_shared_experts, m)]
        if self.ep > 1:
            need.append(("routed experts (n_routed_experts)", cfg.n_routed_experts, self.ep))
        else:
            need.append(("expert intermediate size (moe_intermediate_size)", cfg.moe_intermediate_size, m))
        bad = [f"{what} = {n} is not divisible by {by}" for what, n, by in need if n % by]
        if bad:
            raise LayoutError(f"cannot shard over tensor_parallel_size={self.tp}, expert_parallel_size={self.ep}: "
                              + "; ".join(bad))


def make_layout(cfg: TextConfig, tp: int, ep: int, rank: int) -> ParallelLayout:
    layout = ParallelLayout(tp, ep, rank)
    layout.check(cfg)
    return layout
