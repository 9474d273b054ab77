"""``SchedulerConfig``: the scheduler's limits, derived once from an ``EngineConfig``. Pure Python; no torch."""

from __future__ import annotations

from dataclasses import dataclass, fields

from flashinfra.engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, derived from an ``EngineConfig`` by ``from_engine`` (which validated them);
    no defaults of its own."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # resolved: the model's limit, or the config's if lower
    max_prefill_chunk: int  # cap on the tokens one request takes in a step (0: none)
    speculative_tokens: int  # draft tokens per decode step (0: no speculation)
    deterministic: bool  # prefill pieces cut at multiples of DETERMINISTIC_ALIGN
    # a step may be scheduled while the previous one runs (placeholder tokens); resolved: never with speculative
    # decoding (a verify step's emitted tokens are not one per row), a disaggregated role (a finished export's
    # cache is sent after its step) or several ranks (each rank would need the step in flight)
    async_scheduling: bool

    @classmethod
    def from_engine(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        one_rank = config.tensor_parallel_size == config.expert_parallel_size == config.context_parallel_size == 1
        wanted = config.async_scheduling
        if wanted is None:  # on where a launched step runs on a GPU while the host goes on (a resolved device)
            wanted = config.device.startswith("cuda")
        ahead = wanted and not config.speculative_tokens and config.role == "both" and one_rank
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)
                      if f.name not in ("max_model_len", "async_scheduling")},
                   max_model_len=max_model_len, async_scheduling=ahead)
