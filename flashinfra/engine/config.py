"""The engine's settings, declared once: ``LoadConfig`` (which model, in which dtype, on which device) and
``EngineConfig`` (a ``LoadConfig`` plus cache size and batching limits).

Every field carries its help text in ``metadata["help"]``; ``add_config_args`` turns the fields into
command-line flags (``max_num_seqs`` -> ``--max-num-seqs``, type and default from the field) and
``from_args`` reads them back, so every command that builds an engine (``serve``, ``generate``) or loads a
model (``eval``) offers the same flags with the same meaning. ``flashinfra.LLM(**kwargs)`` takes the same
names. "auto" values are resolved in one place, ``LoadConfig.resolved``.

Pure data, no torch at import, so the server can build a config from its command line and send it to the
engine process (as msgpack).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

DTYPES = ("auto", "float32", "bfloat16", "float16")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_memory(text: str | int) -> int:
    """Bytes in ``text`` (``"2GiB"``, ``"512MB"``, ``"1e9"``, ``4096``)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read a memory size from {text!r} (examples: 2GiB, 512MB, 1000000)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"a memory size is a number of bytes or a string such as '2GiB', got {text!r}")
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def resolve_device(device: str) -> str:
    """``"auto"``: ``"cuda"`` when CUDA is available, else ``"cpu"``; any other value unchanged."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"``: ``"bfloat16"`` on CUDA, ``"float32"`` on the CPU; any other value unchanged."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolve_device(device).startswith("cuda") else "float32"


def check_device(device: str) -> str:
    """``device`` if it names a device the engine runs on (auto, cpu, cuda, cuda:N), else ``ValueError``."""
    if not isinstance(device, str) or not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"unknown device {device!r}; choose auto, cpu, cuda or cuda:N")
    return device


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None, min: int | float | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None) -> Any:
    """A config field: its default, its help text, its smallest valid value and, for the command line, its
    choices, its parser (``str`` -> value, raising ``ValueError``) and its metavar."""
    meta: dict[str, Any] = {"help": help}
    if min is not None:
        meta["min"] = min
    if choices is not None:
        meta["choices"] = choices
    if parse is not None:
        meta["parse"] = parse
    if metavar is not None:
        meta["metavar"] = metavar
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class LoadConfig:
    """Which model to load: from where, in which dtype and weight format, on which device, with which cache
    dtypes."""

    model: str | None = option(None, "checkpoint directory (default: the built-in default model)", metavar="DIR")
    dtype: str = option("auto", "parameter and cache dtype; auto: bfloat16 on CUDA, float32 on the CPU",
                        choices=DTYPES)
    device: str = option("auto", "cpu, cuda or cuda:N; auto: cuda when available", parse=check_device,
                         metavar="DEVICE")
    quantization: str = option("auto", "weights: auto (as the checkpoint stores them), none, w8a8 (int8 per "
                                       "channel x int8 per token) or fp8 (e4m3 per 128x128 block)",
                               choices=("auto", "none", "w8a8", "fp8"))
    kv_cache_dtype: str = option("auto", "MLA latent cache: auto (the model dtype), bfloat16, fp8 or int8 "
                                         "(8-bit with a per-token scale)", choices=("auto", "bfloat16", "fp8", "int8"))
    kv_cache_dtype_layers: str | None = option(
        None, "per-layer latent cache dtypes over --kv-cache-dtype, e.g. first:bfloat16,last:bfloat16,7:fp8",
        metavar="SPEC")
    kda_state_dtype: str = option("float32", "KDA recurrent state dtype", choices=("float32", "bfloat16"))
    load_format: str = option("auto", "auto: the checkpoint's weights; random: random weights drawn on the device "
                                      "from config.json alone (each rank its own shard), for sizing and speed runs "
                                      "without a download", choices=("auto", "random"))

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        check_device(self.device)
        check_fields(self)

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """One command-line flag per field of this class (see ``add_config_args``)."""
        add_config_args(parser, cls)

    @classmethod
    def from_args(cls: type[_C], args: argparse.Namespace) -> _C:
        """This config from flags parsed after ``add_args``; ``ValueError`` on invalid values."""
        return from_args(cls, args)

    def resolved(self: _C) -> _C:
        """This config with ``device`` and ``dtype`` concrete ("auto" resolved for this machine)."""
        device = resolve_device(self.device)
        return dataclasses.replace(self, device=device, dtype=resolve_dtype(self.dtype, device))


_C = TypeVar("_C", bound=LoadConfig)
_T = TypeVar("_T")


@dataclass(frozen=True)
class EngineConfig(LoadConfig):
    """Everything one engine is built from."""

    block_size: int = option(16, "tokens per paged cache block", min=1)
    num_blocks: int | None = option(None, "paged cache blocks (default: as many as --kv-cache-memory holds)",
                                    min=1)
    kv_cache_memory: int | None = option(
        None, "memory for the cache blocks and KDA state slots, e.g. 2GiB "
              "(default: 85% of the free GPU memory, or 256MiB on the CPU)",
        min=1, parse=parse_memory, metavar="SIZE")
    max_num_seqs: int = option(64, "most requests in one batch, and the number of KDA state slots", min=1)
    max_num_batched_tokens: int = option(2048, "token budget of one engine step", min=1)
    max_model_len: int | None = option(
        None, "longest sequence, prompt and output (default: the model's max_position_embeddings, "
              "capped by the cache)", min=2)
    max_prefill_chunk: int = option(
        0, "most prompt tokens one request takes in a step, so a long prompt cannot starve decodes "
           "(0: the whole token budget)", min=0)
    prefix_cache_slots: int | None = option(
        None, "KDA state checkpoints kept for prefix caching (default: --max-num-seqs; 0: prefix caching off)",
        min=0)
    prefix_checkpoint_interval: int = option(
        1024, "prompt tokens between prefix-cache checkpoints (plus one at the prompt's end)", min=1)
    startup_warmup: bool = option(
        True, "capture every decode CUDA graph and compile the prefill kernels at start-up, so no step while "
              "serving waits for them (off: each is made when first needed)")
    seed: int = option(0, "seeds the sampling of requests that give no seed of their own")
    async_scheduling: bool | None = option(
        None, "schedule and prepare the next step while the device runs this one (its decode rows' input token "
              "taken on the device from this step's samples); steps with a grammar, a preemption or a prefix "
              "checkpoint run synchronously, as do speculative decoding and disaggregated roles (default: on "
              "with a GPU; off on a CPU, where launching a step computes it, so nothing overlaps)")
    speculative_tokens: int = option(
        0, "draft tokens per decode step from the checkpoint's MTP layer, verified in one target step (0: off)",
        min=0)
    speculative_max_batch: int = option(
        0, "with speculative decoding, draft only while a step leaves at most this many requests decoding; past it "
           "the steps decode plainly and the MTP layer's catch-up waits (0: always draft)", min=0)
    events_path: str | None = option(
        None, "write the engine's runtime events here, as JSONL (default: not written)", metavar="FILE")
    gil_probe_ms: float | None = option(
        None, "report GIL stalls of the engine longer than this many milliseconds, as gil_stall events "
              "(default: off)", min=0)
    enable_vision: bool = option(False, "load the vision tower and accept images and video "
                                        "(off: text only, no encoder memory reserved)")
    encoder_address: str = option(
        "", "with --enable-vision: the encode-role engine (its --transfer-address) that makes this engine's image "
            "and video embeddings, so no vision tower is loaded here (flashinfra router --encode names one per "
            "request instead)", metavar="ADDR")
    encoder_cache_memory: int = option(256 * 2**20, "bytes of vision encoder outputs kept by content hash",
                                       min=0, parse=parse_memory, metavar="SIZE")
    media_max_bytes: int = option(20 * 2**20, "encoded size of one image or video in a request", min=1,
                                  parse=parse_memory, metavar="SIZE")
    media_max_pixels: int = option(40_000_000, "decoded pixels of one image or video frame", min=1)
    media_max_frames: int = option(256, "sampled frames of one video", min=1)
    media_max_items: int = option(8, "images and videos in one request", min=0)
    allowed_media_hosts: str = option("", "comma-separated hosts whose http(s) media URLs the server may fetch "
                                          "(empty: none)", metavar="HOSTS")
    tensor_parallel_size: int = option(
        1, "ranks (one process per GPU) that split attention heads, MLP widths and the vocabulary", min=1)
    expert_parallel_size: int = option(
        1, "ranks that split the routed experts (each holds whole experts); 1: every tensor-parallel rank "
           "holds a slice of every expert. The engine runs on max(tensor, expert) parallel sizes ranks", min=1)
    context_parallel_size: int = option(
        1, "ranks (one process per GPU, each holding the whole model) that split the prefill of one long prompt; "
           "with --tensor-parallel-size T: T x N ranks, each group of T holding the model split by heads", min=1)
    context_parallel_zigzag: bool = option(
        True, "split a long prompt into 2N parts, rank r holding parts r and 2N-1-r, which balances the MLA "
              "indexer's causal work (else N contiguous parts)")
    layer_split: bool = option(
        False, "with --context-parallel-size > 1: each rank keeps only its own MLA layers' cache (plus one "
               "transient layer), so its cache holds more tokens; the owner broadcasts a layer before it runs")
    nnodes: int = option(1, "hosts the ranks are spread over (evenly)", min=1)
    node_rank: int = option(0, "this host's index among --nnodes; host 0 runs the scheduler", min=0)
    master_addr: str = option("127.0.0.1", "address of host 0, where the ranks meet", metavar="HOST")
    master_port: int = option(0, "port on host 0 where the ranks meet (0: a free port; one host only)", min=0)
    deterministic: bool = option(
        False, "batch-invariant, deterministic outputs: each request's tokens the same bits whatever else runs with "
               "it (fixed reduction orders, prefill chunks aligned to the KDA chunk; slower)")
    dist_timeout_s: float = option(
        120.0, "seconds a collective may wait for a peer before failing the step (a dead or hung rank)", min=1)
    role: str = option("both", "disaggregated serving: prefill (compute prompts, send their cache to a decode "
                               "engine), decode (continue requests from a received cache), encode (the vision "
                               "tower alone, for prefill engines) or both",
                       choices=("both", "prefill", "decode", "encode"))
    transfer_address: str = option("tcp://127.0.0.1:*", "decode/encode roles: where request states (or "
                                                        "images) are received (* picks a free port)", metavar="ADDR")
    transfer_backend: str = option(
        "zmq", "prefill/decode roles: how cache bytes move: zmq (as frames over the control connection), "
               "mooncake (the Mooncake transfer engine, on the host of --transfer-address) or ipc (one host: the "
               "decode engine maps the prefill engine's cache, by CUDA IPC on GPUs, shared memory on CPUs)",
        choices=("zmq", "mooncake", "ipc"))
    transfer_timeout_s: float = option(
        60.0, "prefill/decode roles: seconds a cache transfer may wait for its other side before the request "
              "fails", min=0.1)

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory", "encoder_cache_memory", "media_max_bytes"):
            if isinstance(getattr(self, name), str):  # "2GiB", from LLM(kv_cache_memory="2GiB")
                object.__setattr__(self, name, parse_memory(getattr(self, name)))
        super().__post_init__()

    @property
    def resolved_prefix_slots(self) -> int:
        return self.max_num_seqs if self.prefix_cache_slots is None else self.prefix_cache_slots


def check_fields(config: Any) -> None:
    """``ValueError`` naming the first field of the dataclass ``config`` below its ``min`` (or of the wrong
    type); ``None`` passes where it is the field's default."""
    for f in dataclasses.fields(config):
        if "choices" in f.metadata and getattr(config, f.name) not in f.metadata["choices"]:
            raise ValueError(f"unknown {f.name} {getattr(config, f.name)!r}; choose one of "
                             f"{', '.join(f.metadata['choices'])}")
        if "min" in f.metadata:
            value = getattr(config, f.name)
            if value is None and f.default is None:
                continue
            try:
                _check_min(value, f.metadata["min"], _scalar_type(type(config), f.name))
            except ValueError as e:
                raise ValueError(f"{f.name} {e}") from None


def _check_min(value: Any, low: int | float, kind: type) -> None:
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"must be an integer, got {value!r}")
    if kind is float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise ValueError(f"must be a number, got {value!r}")
    if value < low:
        raise ValueError(f"must be >= {low}, got {value!r}")


# ---- the command line, generated from the fields ----

def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(cls: type, name: str) -> type:
    """The field's type without ``None``: ``int | None`` -> ``int``."""
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        (hint,) = args
    return hint


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type = EngineConfig,
                    only: tuple[str, ...] | None = None) -> None:
    """One flag per field of the config class ``cls`` (or per field named in ``only``): name, type, default,
    choices and help from the field."""
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} has no metadata['help']: every setting is documented")
        kind = _scalar_type(cls, f.name)
        text = f.metadata["help"].replace("%", "%%")
        if kind is bool:  # --flag / --no-flag (a None default is explained by the help text itself)
            parser.add_argument(flag_name(f.name), default=f.default, dest=f.name,
                                action=argparse.BooleanOptionalAction,
                                help=text + (" (default: %(default)s)" if f.default is not None else ""))
            continue
        if f.default is not None:  # a None default is explained by the help text itself
            text += " (default: %(default)s)"
        kwargs: dict[str, Any] = {"default": f.default, "help": text, "dest": f.name,
                                  "type": _cli_type(kind, f.metadata)}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        else:
            kwargs["metavar"] = f.metadata.get("metavar", {int: "N", float: "X"}.get(kind, "STR"))
        parser.add_argument(flag_name(f.name), **kwargs)


def _cli_type(kind: type, meta: Any) -> Callable[[str], Any]:
    """The flag's parser: the field's ``parse`` or type, then its ``min``; errors name the problem."""
    parse = meta.get("parse")

    def convert(text: str) -> Any:
        if parse is not None:
            try:
                value = parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        else:
            try:
                value = kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                                 f"got {text!r}") from None
        if "min" in meta:
            try:
                _check_min(value, meta["min"], kind)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return value

    convert.__name__ = kind.__name__
    return convert


def from_args(cls: type[_T], args: argparse.Namespace) -> _T:
    """The ``cls`` config of parsed flags (added by ``add_config_args``); ``ValueError`` on invalid values."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def config_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` checked against the fields of ``cls`` (a clear error naming the valid ones)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} option(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    return kwargs
