"""The engine over several ranks: rank 0 runs ``EngineCore`` (scheduler, sampling, replies), every other
rank runs ``worker_main``, and each step's ``Plan`` goes from rank 0 to all of them.

Process model: one process per GPU (rank). Rank 0 lives where the engine lives (the ``LLM`` object's
process or the server's engine process) and starts the other ranks of its host; hosts other than 0 start
theirs with ``run_worker_node``. Every rank reads only its shard of the checkpoint (``load.load_shard``);
rank 0 sizes the cache and sends the block count, so every rank allocates the same blocks and slots. Per step rank 0 encodes the
plan (msgspec), broadcasts it over the control group, and all ranks run ``ModelRunner.execute`` on it in
lockstep; the workers' sampled tokens are discarded (their logits equal rank 0's after the all-gather).

Context parallelism (``--context-parallel-size N``, not combined with tensor parallelism yet): every rank
loads the whole model as a ``ContextParallelModel``; the scheduler, the plans and the cache sizing are the
same, and a step that prefills one long prompt (or a long chunk of one) alone is split over the ranks. With
``--layer-split`` the cache is sized by the busiest rank's MLA layers, and rank 0 reports the cache tokens per
rank against full replication at start-up.

Failure: rank 0 checks its local workers before each step, so a dead rank fails the step's requests
at once with its exit code; a hung or remote rank fails them when the compute collective times out
(``dist_timeout_s``). Once a rank is lost every later step fails the same way: the engine cannot recover
a lost shard, so the owner of the engine should shut it down.
"""

from __future__ import annotations

import atexit
import dataclasses
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import msgspec

from flashinfra.engine.config import EngineConfig
from flashinfra.engine.core import EngineCore
from flashinfra.engine.sched.plan import Plan, StepResult

PLAN_ENCODER = msgspec.msgpack.Encoder()


def is_parallel(config: EngineConfig) -> bool:
    return max(config.tensor_parallel_size, config.expert_parallel_size, config.context_parallel_size) > 1


def world_size(config: EngineConfig) -> int:
    """Ranks of the engine: the tensor-parallel ranks, or the context-parallel ones (not combined yet)."""
    return config.tensor_parallel_size * config.context_parallel_size


def make_engine(config: EngineConfig, model=None, events=None) -> EngineCore:
    """``EngineCore`` on one rank; a ``ParallelEngineCore`` (which starts the other ranks) on several."""
    if config.layer_split and config.context_parallel_size == 1:
        raise ValueError("layer_split needs context_parallel_size > 1: it splits the MLA cache over those ranks")
    if not is_parallel(config):
        return EngineCore(config, model, events)
    if model is not None:
        raise ValueError("parallel engines load their own weights on every rank: pass a model directory, not a model")
    return ParallelEngineCore(config, events)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ranks_per_node(config: EngineConfig) -> int:
    world, n = world_size(config), config.nnodes
    if world % n:
        raise ValueError(f"{world} ranks (tensor_parallel_size x context_parallel_size) are not divisible by "
                         f"nnodes {n}")
    return world // n


def _rank_device(config: EngineConfig, rank: int) -> str:
    device = config.device
    return f"cuda:{rank % ranks_per_node(config)}" if device.startswith("cuda") else device


def _model_dir(config: EngineConfig) -> Path:
    from flashinfra.model.factory import default_model_dir

    return Path(config.model) if config.model else default_model_dir()


def check_layout(config: EngineConfig) -> None:
    """Refuse, before any process starts, a world that does not divide the model (numbers in the message)."""
    from flashinfra.config import load_config
    from flashinfra.parallel.layout import make_layout

    if config.enable_vision:
        raise ValueError("enable_vision is not supported with tensor/expert/context parallelism yet")
    if config.context_parallel_size > 1 and (config.tensor_parallel_size > 1 or config.expert_parallel_size > 1):
        raise ValueError(f"context_parallel_size {config.context_parallel_size} with tensor_parallel_size "
                         f"{config.tensor_parallel_size} / expert_parallel_size {config.expert_parallel_size}: "
                         "context parallelism runs over ranks that each hold the whole model (not combined yet)")
    # a rank's shard is sliced from the checkpoint as stored: 8-bit weights and caches are not sliced yet
    if config.quantization in ("w8a8", "fp8") or config.kv_cache_dtype in ("fp8", "int8") \
            or config.kv_cache_dtype_layers or config.kda_state_dtype != "float32":
        raise ValueError(f"quantization={config.quantization}, kv_cache_dtype={config.kv_cache_dtype}, "
                         f"kda_state_dtype={config.kda_state_dtype} are not supported with tensor/expert "
                         f"parallelism yet (use the defaults)")
    make_layout(load_config(_model_dir(config)).text, config.tensor_parallel_size, config.expert_parallel_size, 0)
    ranks_per_node(config)


def _join_world(config: EngineConfig, rank: int, init_method: str):
    """Join the process groups and load this rank's shard -> (sharded model, comm)."""
    from flashinfra.config import load_config
    from flashinfra.parallel.collectives import Comm
    from flashinfra.parallel.groups import control_group, init_distributed
    from flashinfra.parallel.layout import make_layout
    from flashinfra.parallel.load import load_shard

    device = _rank_device(config, rank)
    world = world_size(config)
    init_distributed(rank, world, device, init_method, timeout_s=config.dist_timeout_s)
    comm = Comm(world, device=device, control_group=control_group())
    path = _model_dir(config)
    if config.context_parallel_size > 1:
        from flashinfra.model.api import load_model
        from flashinfra.parallel.context_model import ContextParallelModel
        from flashinfra.parallel.load import peak_host_bytes

        model = ContextParallelModel(load_model(path, config.dtype, device), comm, rank,
                                     zigzag=config.context_parallel_zigzag, layer_split=config.layer_split)
        model.peak_host_bytes = peak_host_bytes()
        return model, comm
    layout = make_layout(load_config(path).text, world, config.expert_parallel_size, rank)
    return load_shard(path, layout, comm, config.dtype, device), comm


def _max_model_len(config: EngineConfig, model) -> int:
    text = model.config.text
    return min(config.max_model_len or text.max_position_embeddings, text.max_position_embeddings)


def _report_rank(rank: int, model) -> None:
    from flashinfra.parallel.shard import weight_bytes

    print(f"flashinfra rank {rank}: {weight_bytes(model.model) / 2**30:.3f} GiB of weights, peak host memory "
          f"{model.peak_host_bytes / 2**30:.3f} GiB while loading", file=sys.stderr, flush=True)


def _next_plan(comm, rank: int) -> bytes:
    """The next plan's bytes; empty when rank 0 stops the engine or is gone (its connection closed)."""
    try:
        return comm.broadcast_bytes(None)
    except RuntimeError as e:
        print(f"flashinfra rank {rank}: rank 0 is gone ({str(e).splitlines()[0][:200]}); exiting",
              file=sys.stderr, flush=True)
        return b""


def worker_main(rank: int, config_bytes: bytes, init_method: str) -> None:
    """A rank other than 0: load the shard, then run every plan rank 0 sends until an empty one."""
    from flashinfra.engine.runner import ModelRunner
    from flashinfra.parallel.groups import destroy_distributed

    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    model, comm = _join_world(config, rank, init_method)
    _report_rank(rank, model)
    try:
        num_blocks = int(comm.broadcast_bytes(None).decode())
        runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs, config.seed,
                             config.resolved_prefix_slots, encoder_cache_bytes=config.encoder_cache_memory)
        while data := _next_plan(comm, rank):
            try:
                runner.execute(msgspec.msgpack.decode(data, type=Plan))
            except Exception:  # rank 0 fails the step's requests; this rank stays in step with it
                traceback.print_exc()
    finally:
        destroy_distributed()


def _start_workers(config: EngineConfig, ranks: range, init_method: str) -> list[subprocess.Popen]:
    """Fresh interpreters (``python -m flashinfra.parallel.engine RANK INIT``, config on stdin): the
    engine process that starts them is itself a daemon process, which multiprocessing forbids to have
    children, and a fresh interpreter shares no CUDA state with its parent."""
    payload = msgspec.msgpack.encode(config)
    procs = []
    for rank in ranks:
        p = subprocess.Popen([sys.executable, "-m", "flashinfra.parallel.engine", str(rank), init_method],
                             stdin=subprocess.PIPE)
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
    return procs


def run_worker_node(config: EngineConfig) -> None:
    """On a host other than 0 (``--node-rank k``): start this host's ranks and wait for them."""
    config = config.resolved()
    per = ranks_per_node(config)
    if config.node_rank == 0 or config.master_port == 0:
        raise ValueError("run_worker_node is for --node-rank >= 1 with an explicit --master-port")
    init = f"tcp://{config.master_addr}:{config.master_port}"
    procs = _start_workers(config, range(config.node_rank * per, (config.node_rank + 1) * per), init)
    for p in procs:
        p.wait()


class PlanBroadcaster:
    """Rank 0's runner: sends each plan to the other ranks, then runs it here."""

    def __init__(self, runner, comm, workers: list) -> None:
        self.runner, self.comm, self.workers = runner, comm, workers
        self.lost: str | None = None

    def __getattr__(self, name):  # generators, embedder, cache...: the local runner's
        return getattr(self.runner, name)

    def execute(self, plan: Plan) -> StepResult:
        if self.lost is None:
            dead = [f"rank {i + 1} (pid {p.pid}) exited with code {p.returncode}"
                    for i, p in enumerate(self.workers) if p.poll() is not None]
            if dead:
                self.lost = "tensor-parallel worker lost: " + "; ".join(dead)
        if self.lost is not None:
            raise RuntimeError(self.lost)
        try:
            self.comm.broadcast_bytes(PLAN_ENCODER.encode(plan))
            return self.runner.execute(plan)
        except Exception as e:
            if "timed out" in str(e).lower() or "connection" in str(e).lower():
                self.lost = f"tensor-parallel collective failed (a rank died or hung): {e}"
            raise

    def stop(self) -> None:
        if self.lost is None:
            try:
                self.comm.broadcast_bytes(b"")
            except Exception:
                pass


class ParallelEngineCore(EngineCore):
    """Rank 0 of a tensor/expert parallel engine: the scheduler runs here once."""

    def __init__(self, config: EngineConfig, events=None) -> None:
        from flashinfra.engine.runner import size_cache

        config = config.resolved()
        check_layout(config)
        if config.node_rank != 0:
            raise ValueError(f"node_rank {config.node_rank}: only host 0 runs the engine; other hosts run "
                             "their ranks with run_worker_node")
        if config.nnodes > 1 and config.master_port == 0:
            raise ValueError("several hosts (--nnodes > 1) need an explicit --master-port that every host uses")
        port = config.master_port or _free_port()
        init = f"tcp://{config.master_addr}:{port}"
        self.workers = _start_workers(config, range(1, ranks_per_node(config)), init)
        try:
            model, comm = _join_world(config, 0, init)
            _report_rank(0, model)
            context = config.context_parallel_size > 1
            per_block = model.cache_bytes_per_block(config.block_size) if context else None
            num_blocks = size_cache(model, config, _max_model_len(config, model), per_block)
            if context:
                print(f"flashinfra: {model.describe_cache(num_blocks, config.block_size)}", file=sys.stderr,
                      flush=True)
            comm.broadcast_bytes(str(num_blocks).encode())
            super().__init__(dataclasses.replace(config, num_blocks=num_blocks), model=model, events=events)
        except BaseException:
            self._stop_workers()
            raise
        self.runner = PlanBroadcaster(self.runner, comm, self.workers)
        self._closed = False
        atexit.register(self.close)  # an ``LLM`` dropped at exit still stops its ranks cleanly

    @property
    def fatal_error(self) -> str | None:
        """Set once a rank is lost: the engine cannot go on (its owner should report this and exit)."""
        return self.runner.lost

    def _stop_workers(self) -> None:
        for p in self.workers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        from flashinfra.parallel.groups import destroy_distributed

        if self._closed:
            return
        self._closed = True
        super().close()
        self.runner.stop()
        self._stop_workers()
        destroy_distributed()


if __name__ == "__main__":
    # a worker rank: lives as long as rank 0 (its stop message or its lost connection ends it), not a
    # terminal's Ctrl-C, which rank 0's owner handles by shutting the engine down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker_main(int(sys.argv[1]), sys.stdin.buffer.read(), sys.argv[2])
