"""The engine over several ranks: rank 0 runs ``EngineCore`` (scheduler, sampling, replies), every other
rank runs ``worker_main``, and each step's ``Plan`` goes from rank 0 to all of them.

Process model: one process per GPU (rank), started as ``launch.py`` says. Every rank reads only its
shard of the checkpoint (``load.load_shard``); rank 0 sizes the cache and sends the block count, so every
rank allocates the same blocks and slots. Per step rank 0 encodes the plan (msgspec), sends it over the
control channel, and all ranks run ``ModelRunner.execute`` on it in lockstep; the workers' sampled
tokens are discarded (their logits equal rank 0's after the all-gather).

Context parallelism (``--context-parallel-size N``, with ``--tensor-parallel-size`` too, not with expert
parallelism): every rank loads the whole model, or its tensor-parallel group's shard, as a
``ContextParallelModel``; the scheduler, the plans and the cache sizing are the same, and a step that prefills
one long prompt (or a long chunk of one) alone is split over the ranks. With
``--layer-split`` the cache is sized by the busiest rank's MLA layers, and rank 0 reports the cache tokens per
rank against full replication at start-up.

Failure: while the world forms, a rank that rank 0 started and that exits fails the start at once
(``launch.watched``), and any other lost rank fails it within ``dist_timeout_s`` (every group and every
control message carries that timeout). Once serving, rank 0 checks its local workers before each step,
so a dead rank fails the step's requests at once with its exit code; a hung or remote rank fails them
when the compute collective times out. Once a rank is lost every later step fails the same way: the
engine cannot recover a lost shard, so the owner of the engine should shut it down. A worker whose rank 0
is gone or silent past the timeout exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import signal
import sys
import time
import traceback
from pathlib import Path

import msgspec

from flashinfra import env
from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.plan import Plan
from flashinfra.parallel.launch import (Launch, RankLost, config_world, exited, kill_workers, launch_of,
                                        resolve_world, start_workers, stop_workers, watched)

PLAN_ENCODER = msgspec.msgpack.Encoder()


def make_engine(config: EngineConfig, model=None, events=None) -> EngineCore:
    """``EngineCore`` on a world of one; rank 0's ``ParallelEngineCore`` on several. Under a launcher
    (``torchrun``) a process of another rank serves rank 0's steps here and then exits: only rank 0 holds
    an engine."""
    if config.layer_split and config.context_parallel_size == 1:
        raise ValueError("layer_split needs context_parallel_size > 1: it splits the MLA cache over those ranks")
    torchrun = env.torchrun_env()
    config = resolve_world(config, torchrun)
    if config_world(config) == 1:
        return EngineCore(config, model, events)
    if model is not None:
        raise ValueError("tensor/expert parallel engines load their own shards: pass a model directory, not a model")
    if torchrun is None and config.node_rank != 0:
        raise ValueError(f"node_rank {config.node_rank}: only host 0 runs the engine; other hosts run their "
                         "ranks with `flashinfra serve --node-rank k`")
    launch = launch_of(config.resolved(), torchrun)
    if launch.rank != 0:
        worker_main(config, launch)
        raise SystemExit(0)
    return ParallelEngineCore(config, launch, events)


def serving_rank(config: EngineConfig) -> EngineConfig | None:
    """For ``flashinfra serve``: check a parallel configuration before anything starts, then either return
    the config this process serves with (rank 0, or a world of one; its sizes taken from a launcher's
    environment where one started it) or run this host's ranks (``--node-rank`` >= 1, or a launcher's rank
    other than 0) and return None once they end."""
    torchrun = env.torchrun_env()
    config = resolve_world(config, torchrun)
    if config_world(config) == 1:
        return config
    check_layout(config)
    launch = launch_of(config.resolved(), torchrun)
    if launch.rank == 0:
        return config
    if torchrun is not None:
        worker_main(config, launch)
    else:
        for p in start_workers(config.resolved(), launch).values():
            p.wait()
    return None


def _model_dir(config: EngineConfig) -> Path:
    from flashinfra.model.factory import default_model_dir

    return Path(config.model) if config.model else default_model_dir()


def check_layout(config: EngineConfig) -> None:
    """Refuse, before any process starts, a world that does not divide the model (numbers in the message)."""
    from flashinfra.config import load_config
    from flashinfra.parallel.launch import ranks_per_node
    from flashinfra.parallel.layout import make_layout
    from flashinfra.parallel.plan import check_shards
    from flashinfra.quant.cache import CacheSpec

    if config.enable_vision:
        raise ValueError("enable_vision is not supported with tensor/expert/context parallelism yet")
    if config.context_parallel_size > 1 and config.expert_parallel_size > 1:
        raise ValueError(f"context_parallel_size {config.context_parallel_size} with expert_parallel_size "
                         f"{config.expert_parallel_size}: context parallelism combines with tensor parallelism "
                         "only (each tensor-parallel group a whole model), not with expert parallelism yet")
    if config.context_parallel_size > 1 and (config.quantization in ("w8a8", "fp8")
                                             or CacheSpec.of(config) != CacheSpec()):
        raise ValueError(f"context_parallel_size {config.context_parallel_size} with quantization="
                         f"{config.quantization}, kv_cache_dtype={config.kv_cache_dtype}, kda_state_dtype="
                         f"{config.kda_state_dtype}: context-parallel ranks load the checkpoint whole and gather "
                         "model-dtype latents (use the defaults)")
    cfg = load_config(_model_dir(config))
    layout = make_layout(cfg.text, config.tensor_parallel_size, config.expert_parallel_size, 0)
    check_shards(cfg, layout, config.quantization)
    ranks_per_node(config)


def join_world(config: EngineConfig, launch: Launch):
    """Join the process groups and load this rank's shard -> (sharded model, control channel); every
    step bounded by ``config.dist_timeout_s``."""
    from flashinfra.config import load_config
    from flashinfra.parallel.groups import control_channel, init_distributed, make_comms
    from flashinfra.parallel.layout import make_layout
    from flashinfra.parallel.load import load_shard, random_shard
    from flashinfra.quant.cache import CacheSpec

    timeout = config.dist_timeout_s
    init_distributed(launch.rank, launch.world, launch.device, launch.init_method, timeout_s=timeout)
    path = _model_dir(config)
    channel = control_channel(timeout)
    if config.context_parallel_size > 1:
        return _context_parallel_model(config, launch, path), channel
    layout = make_layout(load_config(path).text, config.tensor_parallel_size, config.expert_parallel_size,
                         launch.rank)
    comms = make_comms(layout, timeout)
    if config.load_format == "random":
        return random_shard(load_config(path), layout, comms, config.dtype, launch.device, config.seed,
                            config.quantization, CacheSpec.of(config)), channel
    return load_shard(path, layout, comms, config.dtype, launch.device, config.quantization,
                      CacheSpec.of(config)), channel


def _context_parallel_model(config: EngineConfig, launch: Launch, path: Path):
    """This rank's ``ContextParallelModel``: the whole model, or with ``tensor_parallel_size`` > 1 its shard of
    its tensor-parallel group (rank ``r``: tensor-parallel rank ``r % tp``, context-parallel rank ``r // tp``).
    With ``load_format`` random every rank draws the same weights from ``config.seed``."""
    from flashinfra.config import load_config
    from flashinfra.model.api import load_model, random_model
    from flashinfra.parallel.collectives import Comm
    from flashinfra.parallel.context_model import ContextParallelModel
    from flashinfra.parallel.groups import make_context_comms
    from flashinfra.parallel.layout import make_layout
    from flashinfra.parallel.load import load_shard, peak_host_bytes, random_shard

    tp, cp = config.tensor_parallel_size, config.context_parallel_size
    drawn = config.load_format == "random"
    if tp == 1:
        cp_comm = Comm(launch.world)
        loaded = (random_model(load_config(path), config.dtype, launch.device, config.seed) if drawn
                  else load_model(path, config.dtype, launch.device))
    else:
        comms, cp_comm = make_context_comms(tp, cp, launch.rank, config.dist_timeout_s)
        layout = make_layout(load_config(path).text, tp, 1, launch.rank % tp)
        loaded = (random_shard(load_config(path), layout, comms, config.dtype, launch.device, config.seed) if drawn
                  else load_shard(path, layout, comms, config.dtype, launch.device))
    model = ContextParallelModel(loaded, cp_comm, launch.rank // tp, zigzag=config.context_parallel_zigzag,
                                 layer_split=config.layer_split)
    model.peak_host_bytes = peak_host_bytes()
    return model


def _max_model_len(config: EngineConfig, model) -> int:
    text = model.config.text
    return min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)


def _report_rank(rank: int, model, load_s: float) -> None:
    from flashinfra.parallel.shard import weight_bytes

    device = ""
    if model.device.type == "cuda":
        import torch

        device = f", {torch.cuda.memory_allocated(model.device) / 2**30:.3f} GiB allocated on {model.device}"
    print(f"flashinfra rank {rank}: {weight_bytes(model.model) / 2**30:.3f} GiB of weights ({model.quantization}) "
          f"loaded in {load_s:.1f} s{device}, peak host memory {model.peak_host_bytes / 2**30:.3f} GiB while loading",
          file=sys.stderr, flush=True)


def _next_message(channel, rank: int) -> bytes:
    """The next plan's bytes; empty when rank 0 stops the engine, is gone or stays silent past the timeout."""
    try:
        return channel.recv()
    except RuntimeError as e:
        print(f"flashinfra rank {rank}: rank 0 is gone or silent ({str(e).splitlines()[0][:200]}); exiting",
              file=sys.stderr, flush=True)
        return b""


def worker_main(config: EngineConfig, launch: Launch) -> None:
    """A rank other than 0: load the shard, then run every plan rank 0 sends until it stops."""
    from flashinfra.engine.runner import ModelRunner
    from flashinfra.parallel.groups import destroy_distributed

    config = config.resolved()
    try:
        start = time.perf_counter()
        model, channel = join_world(config, launch)
        _report_rank(launch.rank, model, time.perf_counter() - start)
        if not (data := _next_message(channel, launch.rank)):
            return
        runner = ModelRunner(model, int(data.decode()), config.block_size, config.max_num_seqs, config.seed,
                             config.resolved_prefix_slots, encoder_cache_bytes=config.encoder_cache_memory,
                             deterministic=config.deterministic)
        while data := _next_message(channel, launch.rank):
            try:
                runner.execute(msgspec.msgpack.decode(data, type=Plan))
            except Exception:  # rank 0 fails the step's requests; this rank stays in step with it
                traceback.print_exc()
    finally:
        destroy_distributed()


class PlanBroadcaster:
    """Rank 0's runner: sends each plan to the other ranks, then runs it here."""

    def __init__(self, runner, channel, workers: dict, timeout_s: float) -> None:
        self.runner, self.channel, self.workers = runner, channel, workers
        self.lost: str | None = None
        channel.start_keepalive(timeout_s / 4, self._keepalive_failed)

    def _keepalive_failed(self, e: Exception) -> None:
        self.lost = self.lost or f"tensor-parallel worker lost while idle: {str(e).splitlines()[0][:200]}"

    def __getattr__(self, name):  # generators, embedder, cache...: the local runner's
        return getattr(self.runner, name)

    def launch(self, plan: Plan, prev=None):
        """Send the plan, then launch it here (``finish`` is the local runner's: several ranks never schedule
        ahead, see ``SchedulerConfig.async_scheduling``)."""
        if self.lost is None and (dead := exited(self.workers)):
            self.lost = "tensor-parallel worker lost: " + "; ".join(dead)
        if self.lost is not None:
            raise RankLost(self.lost)
        try:
            self.channel.send(PLAN_ENCODER.encode(plan))
            return self.runner.launch(plan, prev)
        except Exception as e:
            if "timed out" in str(e).lower() or "connection" in str(e).lower():
                self.lost = f"tensor-parallel collective failed (a rank died or hung): {e}"
            raise
        finally:
            self.channel.done()

    def stop(self) -> None:
        self.channel.stop_keepalive()
        if self.lost is None:
            try:
                self.channel.send(b"")
            except Exception:  # noqa: BLE001 - the ranks are gone already; nothing left to stop
                pass


class ParallelEngineCore(EngineCore):
    """Rank 0 of a tensor/expert parallel engine: the scheduler runs here once."""

    def __init__(self, config: EngineConfig, launch: Launch, events=None) -> None:
        from flashinfra.engine.runner import size_cache

        config = config.resolved()
        check_layout(config)
        self.workers = start_workers(config, launch)
        try:
            start = time.perf_counter()
            model, channel = watched(lambda: join_world(config, launch), self.workers,
                                     "a tensor-parallel rank was lost while the engine started")
            if launch.device.startswith("cuda"):  # the current device is per thread: joining set it on its own
                import torch

                torch.cuda.set_device(launch.device)
            _report_rank(0, model, time.perf_counter() - start)
            context = config.context_parallel_size > 1
            per_block = model.cache_bytes_per_block(config.block_size) if context else None
            num_blocks = size_cache(model, config, _max_model_len(config, model), per_block)
            if context:
                print(f"flashinfra: {model.describe_cache(num_blocks, config.block_size)}", file=sys.stderr,
                      flush=True)
            else:
                print(f"flashinfra: {num_blocks} cache blocks of {config.block_size} tokens "
                      f"({num_blocks * config.block_size} cache tokens) on every rank", file=sys.stderr, flush=True)
            channel.send(str(num_blocks).encode())
            # The warm-up's forward passes would run on rank 0 alone while the other ranks wait for plans.
            super().__init__(dataclasses.replace(config, num_blocks=num_blocks, startup_warmup=False), model=model,
                             events=events)
        except BaseException:
            kill_workers(self.workers)
            raise
        self.runner = PlanBroadcaster(self.runner, channel, self.workers, config.dist_timeout_s)
        self._closed = False
        atexit.register(self.close)  # an ``LLM`` dropped at exit still stops its ranks cleanly

    @property
    def fatal_error(self) -> str | None:
        """Set once a rank is lost: the engine cannot go on (its owner should report this and exit)."""
        return self.runner.lost

    def close(self) -> None:
        from flashinfra.parallel.groups import destroy_distributed

        if self._closed:
            return
        self._closed = True
        super().close()
        self.runner.stop()
        stop_workers(self.workers)
        destroy_distributed()


if __name__ == "__main__":
    # a worker rank: lives as long as rank 0 (its stop message or its lost connection ends it), not a
    # terminal's Ctrl-C, which rank 0's owner handles by shutting the engine down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _rank, _init, _device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    _config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    worker_main(_config, Launch(_rank, config_world(_config), _device, _init, ()))
