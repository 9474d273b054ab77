"""``EngineCore``: one model, one scheduler, one runner; ``step()`` advances every running request.

This is the object both front ends share: the offline ``flashinfra.LLM`` calls it directly, and the
engine process (``process.run_engine``) drives it from ZeroMQ messages. It validates requests before they
reach the scheduler (a bad request is refused, never admitted), turns a failed forward pass into an
``error`` finish for the requests of that step only, and reports stats and runtime events. With a prefill or
decode role (disaggregated serving) it exports or imports request states (``flashinfra.disagg.roles``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flashinfra.engine.sched.cache_manager import HybridCacheManager
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.sched.messages import EngineReady, EngineRequest, EngineStats, RequestOutput
from flashinfra.engine.sched.plan import Plan, StepResult
from flashinfra.engine.sched.request import Request
from flashinfra.engine.sched.aligned import DETERMINISTIC_ALIGN, KDA_CHUNK
from flashinfra.engine.sched.scheduler import Scheduler, SchedulerConfig
from flashinfra.feedback.compiles import CompileWatch

logger = logging.getLogger("flashinfra.engine")

if TYPE_CHECKING:
    from flashinfra.engine.runner import StepHandle


def _prefill_budget(config: EngineConfig) -> int:
    """The most prompt tokens of one request in one step."""
    chunk = config.max_prefill_chunk or config.max_num_batched_tokens
    return min(chunk, config.max_num_batched_tokens)


class EngineCore:
    def __init__(self, config: EngineConfig, model: Any = None, events: Any = None) -> None:
        """Load ``config.model`` (or use the already loaded ``model``) and allocate its cache."""
        import flashinfra
        from flashinfra.model.factory import default_model_dir
        from flashinfra.engine.runner import ModelRunner, size_cache
        from flashinfra.quant.cache import CacheSpec

        config = config.resolved()
        if config.deterministic and config.speculative_tokens:
            raise ValueError("deterministic mode does not run speculative decoding (its verify steps replay the KDA "
                             "state in another order); set speculative_tokens=0")
        piece = config.max_prefill_chunk or config.max_num_batched_tokens
        if config.deterministic and piece < 2 * DETERMINISTIC_ALIGN:
            raise ValueError(f"deterministic mode cuts prefills at multiples of {DETERMINISTIC_ALIGN} tokens: "
                             f"max_num_batched_tokens and max_prefill_chunk (when set) must be >= "
                             f"{2 * DETERMINISTIC_ALIGN}")
        if model is None:
            path = Path(config.model) if config.model else default_model_dir()
            # a decode role never encodes: its prompts were computed by a prefill engine; nor does an engine whose
            # images an encode engine embeds
            vision = config.enable_vision and config.role != "decode" and not config.encoder_address
            if config.load_format == "random":
                from flashinfra.config import load_config
                from flashinfra.model.api import random_model

                model = random_model(load_config(path), config.dtype, config.device, config.seed,
                                     config.quantization, CacheSpec.of(config))
            else:
                model = flashinfra.load_model(path, dtype=config.dtype, device=config.device, vision=vision,
                                              quantization=config.quantization, cache_spec=CacheSpec.of(config))
        self.config = config
        self.model = model
        text = model.config.text
        self.vocab_size = text.vocab_size
        self.eos_token_ids = frozenset(text.eos_token_id)
        max_model_len = min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)
        num_blocks = size_cache(model, config, max_model_len)
        self.events = events if events is not None else _make_events(config.events_path)
        self.gil_probe = _start_gil_probe(config.gil_probe_ms, self.events)
        prefix_slots = config.resolved_prefix_slots
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs, config.seed, prefix_slots,
                                  encoder_cache_bytes=config.encoder_cache_memory,
                                  remote_encoder=config.enable_vision and bool(config.encoder_address),
                                  speculative_tokens=config.speculative_tokens, deterministic=config.deterministic,
                                  speculative_max_batch=config.speculative_max_batch)
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine(config, max_model_len),
            HybridCacheManager(num_blocks, config.block_size, config.max_num_seqs, prefix_slots,
                               config.prefix_checkpoint_interval,
                               align=DETERMINISTIC_ALIGN if config.deterministic else 1, chunk=KDA_CHUNK),
            events=self.events,
        )
        self.disagg = None
        if config.role != "both" or config.encoder_address:
            from flashinfra.disagg.roles import make_role

            self.disagg = make_role(self, config)
        # every Triton compilation is a ``kernel_compile`` event; those after the warm-up are specialisations it missed
        self.compiles = CompileWatch(self.events).start() if model.device.type == "cuda" else None
        self.warmup = None
        if config.startup_warmup:
            from flashinfra.engine.warmup import warm_up

            self.warmup = warm_up(self.runner, config.max_num_seqs, max_model_len, _prefill_budget(config),
                                  num_blocks, checkpoint_slot=config.max_num_seqs if prefix_slots else None)
        if self.compiles is not None:
            self.compiles.phase = "serving"
        self._pending: list[RequestOutput] = []
        self._inflight: tuple[Plan, StepHandle | StepResult] | None = None  # launched, its result not applied
        self._last_step_s = 0.0
        self._last_tokens = 0

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        return self.scheduler.max_len

    def ready_message(self) -> EngineReady:
        return EngineReady(
            model_name=self.model.path.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids),
            num_blocks=self.scheduler.cache.num_blocks,
            block_size=self.config.block_size,
            max_num_seqs=self.config.max_num_seqs,
            role=self.config.role,
            transfer_address=getattr(self.disagg, "address", ""),
            transfer_backend=self.config.transfer_backend,
            cache_layout=None if self.disagg is None or self.disagg.layout is None
            else msgspec.to_builtins(self.disagg.layout),
            vision="tower" if self.model.vision is not None else "encoder" if self.runner.embedder is not None else "",
            **self.runner.cache_footprint(),
        )

    @property
    def wake_fd(self) -> int | None:
        """A file descriptor that becomes readable when a transfer needs the engine loop (else None)."""
        return None if self.disagg is None else self.disagg.wake.fd

    def wake_sockets(self) -> list:
        """ZeroMQ sockets that, once readable, need the engine loop (a state sender's connections: handshake
        answers, acks, disconnections); they change as peers come and go."""
        return [] if self.disagg is None else self.disagg.wake_sockets()

    def wake_deadline(self) -> float | None:
        """When (``time.monotonic()``) the engine loop must look even if nothing woke it (a transfer's timeout,
        a packing copy to check), or None."""
        return None if self.disagg is None else self.disagg.wake_deadline()

    def add_request(self, request: EngineRequest) -> None:
        """Queue ``request``; raises ``ValueError`` (and admits nothing) if it is invalid."""
        request.sampling.validate(self.max_model_len)
        ids = request.prompt_token_ids
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in request.sampling.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {self.vocab_size})")
        importing = request.transfer is not None and request.transfer.role == "import"
        embeds = self.runner.embedder is not None
        if (request.mm_items or embeds) and not importing:  # imports were encoded elsewhere
            from flashinfra.multimodal.encoder import validate_request

            validate_request(self.model, ids, request.mm_items, embeds)
        req = Request(request.request_id, list(ids), request.sampling, request.arrival_time, self.eos_token_ids)
        req.mm_items = sorted(request.mm_items, key=lambda it: it.offset)
        req.transfer = request.transfer
        if req.transfer is not None and self.config.role == "both":
            raise ValueError("this engine runs both prefill and decode; kv_transfer_params needs an engine started "
                             "with --role prefill or --role decode")
        if self.disagg is not None and not self.disagg.admit(req):
            return  # admitted to the scheduler when its state (or its images' embeddings) arrives
        self.scheduler.add_request(req)

    def abort(self, request_ids: list[str]) -> None:
        """Free these requests' cache now; their final ``abort`` outputs come with the next ``step``."""
        self._pending.extend(self.scheduler.abort(request_ids))
        if self.disagg is not None:
            self._pending.extend(self.disagg.abort(request_ids))

    def has_unfinished(self) -> bool:
        """Requests to run, or a step in flight (asynchronous scheduling) whose result is still to apply."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def close(self) -> None:
        """Stop what the engine runs beside its steps (the GIL probe, the compile watch)."""
        if self.gil_probe is not None:
            self.gil_probe.stop()
        if self.compiles is not None:
            self.compiles.stop()
        if self.disagg is not None:
            self.disagg.close()

    def has_work(self) -> bool:
        return self.has_unfinished() or bool(self._pending) or (self.disagg is not None and self.disagg.has_events())

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample once; the outputs of one step, in order (plus any pending abort outputs).

        With asynchronous scheduling the step whose outputs come back is the one launched by the previous call:
        the next is scheduled and launched first (when ``Scheduler.can_schedule_ahead`` allows it), so the host
        prepares it while the device runs this one. Otherwise (and always without it) a step is scheduled,
        launched and finished here."""
        outputs, self._pending = self._pending, []
        if self.disagg is not None:
            outputs.extend(self.disagg.poll())
        if self._inflight is None and not self.scheduler.has_unfinished():
            return outputs
        start = time.perf_counter()
        with self.events.span("step") as ev:
            if self._inflight is None:
                plan = self.scheduler.schedule()
                self._inflight = (plan, self._launch(plan, None))
            (plan, handle), self._inflight = self._inflight, None
            ev.update(**_describe(plan), schedule_s=time.perf_counter() - start)
            # a failed launch has no samples for the next step's placeholders; what moves request states between
            # steps (``self.disagg``: roles, remote encoders) sees every step's result before the next is scheduled
            if (not isinstance(handle, StepResult) and self.disagg is None
                    and self.scheduler.can_schedule_ahead(plan)):
                ahead = self.scheduler.schedule(ahead=True)
                if ahead is not None:
                    self._inflight = (ahead, self._launch(ahead, handle))
            stepped = self.scheduler.update(plan, self._finish(plan, handle))
            outputs.extend(stepped if self.disagg is None else self.disagg.after_step(stepped))
        self._last_step_s = time.perf_counter() - start
        self._last_tokens = plan.num_tokens
        cache = self.scheduler.cache
        self.events.emit(
            "cache",
            used_blocks=cache.num_blocks - cache.num_reclaimable_blocks,
            cached_prefix_blocks=cache.num_reclaimable_blocks - cache.num_free_blocks,
            total_blocks=cache.num_blocks,
            used_slots=cache.num_slots - cache.num_free_slots,
            total_slots=cache.num_slots,
        )
        return outputs

    def _launch(self, plan: Plan, prev: StepHandle | None) -> StepHandle | StepResult:
        """The launched step, or the result failing its requests (the engine and other requests go on)."""
        try:
            return self.runner.launch(plan, prev)
        except Exception as e:
            return _failed(plan, e)

    def _finish(self, plan: Plan, handle: StepHandle | StepResult) -> StepResult:
        if isinstance(handle, StepResult):
            return handle
        try:
            return self.runner.finish(handle)
        except Exception as e:
            return _failed(plan, e)

    def stats(self) -> EngineStats:
        stats = self.scheduler.stats(self._last_step_s, self._last_tokens)
        if (embedder := self.runner.embedder) is not None:
            stats.num_encoded_items_total = embedder.num_encoded
            stats.num_encoder_cache_hits_total = embedder.cache.hits
            stats.num_encoder_cache_misses_total = embedder.cache.misses
            stats.encoder_seconds_total = embedder.encode_seconds
            stats.encoder_cache_bytes = embedder.cache.nbytes
        if self.disagg is not None:
            stats.num_transfers_total = self.disagg.num_total
            stats.num_transfer_failures_total = self.disagg.num_failures
        return stats


def _describe(plan: Plan) -> dict[str, Any]:
    """A step's ``step`` event fields."""
    decode = [sr for sr in plan.scheduled if sr.num_new_tokens == 1 and sr.context_len >= len(sr.prompt_token_ids)]
    return dict(step=plan.step_id, num_reqs=len(plan.scheduled), num_prefill_tokens=plan.num_tokens - len(decode),
                num_decode_tokens=len(decode), num_prefill_reqs=len(plan.scheduled) - len(decode),
                num_preempted=len(plan.preempted_ids))


def _failed(plan: Plan, e: Exception) -> StepResult:
    """The step's requests fail with ``e``'s message; its traceback goes to the log."""
    msg = f"model step failed: {type(e).__name__}: {e}"
    logger.error("%s (%d requests failed)", msg, len(plan.scheduled), exc_info=e)
    return StepResult(errors={sr.request_id: msg for sr in plan.scheduled})


def _start_gil_probe(threshold_ms: float | None, events: Any) -> Any:
    """A running GIL probe that reports stalls as ``gil_stall`` runtime events, or None when disabled."""
    if not threshold_ms:
        return None
    from flashinfra.feedback.gil_probe import GilProbe

    return GilProbe(threshold_s=threshold_ms / 1e3, events=events).start()


def _make_events(path: str | None) -> Any:
    from flashinfra.feedback.events import EventLog

    return EventLog(path)
