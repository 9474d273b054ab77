"""One declaration of every engine setting: ``EngineConfig``'s fields are the flags of every command that
builds an engine or loads a model, ``SchedulerConfig`` derives from it, and bad values fail clearly."""

from __future__ import annotations

import argparse
import dataclasses
import re
import threading
from pathlib import Path

import msgspec
import pytest

from flashinfra.cli import build_parser
from flashinfra.engine.config import DTYPES, EngineConfig, LoadConfig, flag_name, parse_memory
from flashinfra.engine.sched.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


def _subcommand(*names: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


ENGINE_COMMANDS = [("serve",), ("generate",)]
LOAD_COMMANDS = ENGINE_COMMANDS + [("eval", "perplexity")]
DTYPE_COMMANDS = LOAD_COMMANDS + [("trace",), ("ab",)]


@pytest.mark.parametrize("command", LOAD_COMMANDS, ids=" ".join)
def test_every_field_is_a_flag_with_its_default_and_help(command):
    cls = EngineConfig if command in ENGINE_COMMANDS else LoadConfig
    actions = _actions(_subcommand(*command))
    for f in dataclasses.fields(cls):
        action = actions.get(flag_name(f.name))
        assert action is not None, f"{' '.join(command)} has no {flag_name(f.name)}"
        assert action.dest == f.name
        assert action.default == f.default, f.name
        assert f.metadata["help"], f.name
        assert action.help.replace("%%", "%").startswith(f.metadata["help"]), f.name


def test_every_option_of_every_command_has_help():
    """Help text is what makes argparse show an option's default: no option of any subcommand goes without."""
    def missing(parser, path):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from missing(sub, [*path, name])
            elif a.option_strings and a.help is None:
                yield f"{' '.join(path)} {a.option_strings[0]}"

    assert not list(missing(build_parser(), ["flashinfra"]))


def test_serve_options_are_flags_and_only_on_serve():
    from flashinfra.server.cli import ServeOptions

    serve, generate = _actions(_subcommand("serve")), _actions(_subcommand("generate"))
    for f in dataclasses.fields(ServeOptions):
        action = serve[flag_name(f.name)]
        assert (action.dest, action.default) == (f.name, f.default)
        assert action.help.replace("%%", "%").startswith(f.metadata["help"])
        assert flag_name(f.name) not in generate
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert not engine & {f.name for f in dataclasses.fields(ServeOptions)}


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_flags_build_the_config(command):
    argv = [*command, "--max-num-seqs", "3", "--kv-cache-memory", "2GiB", "--max-prefill-chunk", "40",
            "--dtype", "bfloat16", "--device", "cpu", "--gil-probe-ms", "2.5", "--model", "/some/dir"]
    if command == ("generate",):
        argv.append("a prompt")
    args = build_parser().parse_args(argv)
    assert EngineConfig.from_args(args) == EngineConfig(
        model="/some/dir", max_num_seqs=3, kv_cache_memory=2 * 2**30, max_prefill_chunk=40, dtype="bfloat16",
        device="cpu", gil_probe_ms=2.5)
    defaults = build_parser().parse_args([*command] + (["p"] if command == ("generate",) else []))
    assert EngineConfig.from_args(defaults) == EngineConfig()


def test_dtype_means_the_same_on_every_command():
    seen = set()
    for command in DTYPE_COMMANDS:
        action = _actions(_subcommand(*command))["--dtype"]
        seen.add((action.default, tuple(action.choices), action.help))
    assert seen == {("auto", DTYPES, _actions(_subcommand("serve"))["--dtype"].help)}, seen
    assert LoadConfig().dtype == "auto"
    auto = dataclasses.replace(LoadConfig(), device="cpu").resolved()
    assert (auto.device, auto.dtype) == ("cpu", "float32")
    assert dataclasses.replace(LoadConfig(), device="cuda:1").resolved().dtype == "bfloat16"
    assert dataclasses.replace(LoadConfig(), device="cpu", dtype="float16").resolved().dtype == "float16"
    assert EngineConfig(device="cpu", max_num_seqs=5).resolved() == EngineConfig(
        device="cpu", dtype="float32", max_num_seqs=5)


def test_no_command_declares_dtype_or_engine_flags_by_hand():
    """The flags come from the config: no module of a command spells them in an add_argument call."""
    engine = [flag_name(f.name) for f in dataclasses.fields(EngineConfig)]
    for rel, names in (("flashinfra/server/cli.py", engine), ("flashinfra/generate.py", engine),
                       ("flashinfra/eval/cli.py", engine), ("flashinfra/feedback/cli.py", ["--dtype", "--device"])):
        text = (ROOT / rel).read_text()
        for name in names:
            assert not re.search(r"add_argument\(\s*['\"]" + re.escape(name) + "['\"]", text), (rel, name)


def test_scheduler_config_is_derived_without_defaults_of_its_own():
    fields = dataclasses.fields(SchedulerConfig)
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {f.name for f in fields} <= engine_fields
    cfg = EngineConfig(max_num_seqs=7, max_num_batched_tokens=99, max_prefill_chunk=33, max_model_len=4000)
    sched = SchedulerConfig.from_engine(cfg, max_model_len=300)
    assert sched == SchedulerConfig(max_num_seqs=7, max_num_batched_tokens=99, max_model_len=300,
                                    max_prefill_chunk=33, speculative_tokens=0, deterministic=False,
                                    async_scheduling=False)
    default = SchedulerConfig.from_engine(EngineConfig(), max_model_len=300)
    for f in fields:
        if f.name not in ("max_model_len", "async_scheduling"):
            assert getattr(default, f.name) == getattr(EngineConfig(), f.name), f.name
    # asynchronous scheduling: by default where a GPU runs the steps, or as asked
    for device, asked, ahead in (("cpu", None, False), ("cuda", None, True), ("cpu", True, True),
                                 ("cuda", False, False)):
        cfg = EngineConfig(device=device, async_scheduling=asked)
        assert SchedulerConfig.from_engine(cfg, max_model_len=300).async_scheduling is ahead


def test_every_engine_setting_is_used():
    """A field nothing reads is an option that does nothing: each appears outside its declaration."""
    sources = [p for p in (ROOT / "flashinfra").rglob("*.py") if p.name != "config.py" or p.parent.name != "engine"]
    text = "\n".join(p.read_text() for p in sources)
    read_as = {"prefix_cache_slots": "resolved_prefix_slots"}  # read through a property of EngineConfig
    for f in dataclasses.fields(EngineConfig):
        name = read_as.get(f.name, f.name)
        assert re.search(r"(config|cfg)\." + name + r"\b", text), f"nothing reads EngineConfig.{f.name}"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["serve", "--max-num-seqs", "many"], "argument --max-num-seqs: expected an integer, got 'many'"),
    (["serve", "--kv-cache-memory", "2 lots"], "argument --kv-cache-memory: cannot read a memory size"),
    (["serve", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["generate", "--device", "tpu", "x"], "argument --device: unknown device 'tpu'"),
    (["generate", "--prefix-cache-slots", "-1", "x"], "argument --prefix-cache-slots: must be >= 0, got -1"),
    (["eval", "perplexity", "--dtype", "float64", "f"], "argument --dtype: invalid choice"),
    (["serve", "--port", "http"], "argument --port: expected an integer"),
])
def test_invalid_flags_fail_with_the_flag_and_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size must be >= 1, got 0"),
    (dict(max_prefill_chunk=-1), "max_prefill_chunk must be >= 0"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an integer, got 2.5"),
    (dict(kv_cache_memory="lots"), "cannot read a memory size"),
    (dict(dtype="float64"), "unknown dtype 'float64'"),
    (dict(device="gpu"), "unknown device 'gpu'"),
    (dict(gil_probe_ms=-1.0), "gil_probe_ms must be >= 0"),
])
def test_invalid_values_fail_with_the_field_and_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**kwargs)


def test_config_is_frozen_and_travels_as_msgpack():
    cfg = EngineConfig(model="/m", kv_cache_memory="512MiB", max_num_seqs=3)
    assert cfg.kv_cache_memory == parse_memory("512MiB")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 4
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig) == cfg
    with pytest.raises(msgspec.ValidationError, match="max_num_seqs must be >= 1"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"max_num_seqs": 0}), type=EngineConfig)


def test_llm_names_unknown_options():
    from flashinfra.llm import LLM

    with pytest.raises(TypeError, match="unknown EngineConfig option.*max_num_seq\\b.*valid: .*max_num_seqs"):
        LLM(max_num_seq=2)


def test_kernel_path_is_a_scoped_context():
    import torch

    from flashinfra.kernels import dispatch

    x = torch.zeros(1)
    default = dispatch.use_triton(x)
    with dispatch.kernel_path(False):
        assert not dispatch.use_triton(x)
        with dispatch.kernel_path(True):
            assert dispatch.use_triton(x) == dispatch.interpreting()
            seen = []
            t = threading.Thread(target=lambda: seen.append(dispatch.use_triton(x)))
            t.start()
            t.join()
            assert seen == [default]  # another thread keeps the process-wide rule
        assert not dispatch.use_triton(x)
    assert dispatch.use_triton(x) == default
