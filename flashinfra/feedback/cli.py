"""The feedback sub-commands: ``check``, ``bench``, ``trace``, ``events``, ``ab`` and ``goals``.

Registration imports nothing heavy; each command imports its module when it runs. ``--dtype`` and
``--device`` are ``LoadConfig``'s flags, with the meaning they have on every other command.
"""

from __future__ import annotations

import argparse
import json
import sys

from flashinfra.engine.config import EngineConfig, LoadConfig, add_config_args
from flashinfra.feedback.trace import TRACE_ENGINE_OPTIONS


def _print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _list_entries(what: str) -> int:
    from flashinfra.feedback import registry

    errors = registry.load_providers()
    for module, tb in errors:
        print(f"ERROR importing provider {module}:\n{tb}", file=sys.stderr)
    table = registry.checks() if what == "checks" else registry.benchmarks()
    for entry in table.values():
        print(f"{entry.name}\t{','.join(entry.tags)}\t{entry.module}")
    return 1 if errors else 0


def _cmd_check(args: argparse.Namespace) -> int:
    from flashinfra.feedback import check, registry

    if args.list:
        return _list_entries("checks")
    try:
        runs, errors, seed = check.run_checks(args.names, seed=args.seed,
                                              providers=registry.PROVIDERS + tuple(args.provider))
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(check.to_json(runs, errors, seed))
    else:
        print(check.format_text(runs, errors, seed))
    return 0 if all(r.passed for r in runs) and not errors else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from flashinfra.feedback import bench

    return bench.cli_main(args.argv)


def _resolve_device_dtype(args: argparse.Namespace) -> None:
    """``--device`` and ``--dtype`` made concrete ("auto" resolved as the engine resolves it)."""
    from flashinfra.engine.config import resolve_device, resolve_dtype

    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)


def _cmd_trace(args: argparse.Namespace) -> int:
    from flashinfra.feedback import trace

    _resolve_device_dtype(args)
    return trace.cli_main(args)


def _cmd_events(args: argparse.Namespace) -> int:
    from flashinfra.feedback import events_summary

    try:
        summary = events_summary.summarize(args.file, windows=args.windows)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        _print_json(summary)
    else:
        print(events_summary.format_text(summary))
    return 0


def _cmd_ab(args: argparse.Namespace) -> int:
    from flashinfra.feedback import ab

    _resolve_device_dtype(args)
    return ab.cli_main(args)


def _cmd_goals(args: argparse.Namespace) -> int:
    from flashinfra.feedback import goals

    report = goals.check_file(args.file, extra_metrics=args.metrics)
    _print_json(report)
    return 0 if report["passed"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("check", help="run correctness checks against float64 references")
    p.add_argument("names", nargs="*", help="check names, prefixes, globs or tags (default: all)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh seed)")
    p.add_argument("--list", action="store_true", help="list the registered checks and exit")
    p.add_argument("--provider", action="append", default=[], help="extra module registering checks")
    p.set_defaults(func=_cmd_check)

    p = subparsers.add_parser(
        "bench", add_help=False, prefix_chars="+",
        help="microbenchmarks: 'bench NAME...', 'bench ceilings', 'bench serve ARGS' (see 'bench --help')")
    # Everything after 'bench' is parsed by flashinfra.feedback.bench, so 'bench serve' can forward its
    # own options untouched to the serving benchmark.
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)

    p = subparsers.add_parser("trace", help="profile a benchmark or model forward steps under torch.profiler")
    p.add_argument("--bench", default=None, help="benchmark to trace")
    p.add_argument("--model", default=None, help="checkpoint to trace ('default' for the built-in model)")
    p.add_argument("--prompt-lens", default="32,17", help="model: comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=3, help="model: forward steps traced")
    p.add_argument("--arrivals", default=None, metavar="N,LEN",
                   help="model: N new requests of LEN tokens join before every step, so steps mix prompts with "
                        "the running rows' decode as a server's do (default: none)")
    add_config_args(p, LoadConfig, only=("dtype", "device"))
    add_config_args(p, EngineConfig, only=TRACE_ENGINE_OPTIONS)
    p.set_defaults(max_num_seqs=None)  # None: as many as the prompts, at least 4
    p.add_argument("--warmup", type=int, default=1, help="model: engine steps run before the traced ones")
    p.add_argument("--quick", action="store_true", help="benchmark: small sizes")
    p.add_argument("--out", default="trace", help="output prefix: PREFIX.json (Chrome trace), PREFIX.txt")
    p.add_argument("--top", type=int, default=15, help="kernels listed in the summary, by time")
    p.set_defaults(func=_cmd_trace)

    p = subparsers.add_parser("events", help="runtime event streams")
    sub = p.add_subparsers(dest="events_command", required=True)
    s = sub.add_parser("summarize", help="timeline summary of a JSONL event file")
    s.add_argument("file")
    s.add_argument("--windows", type=int, default=10, help="timeline buckets")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=_cmd_events)

    p = subparsers.add_parser("ab", help="A/B experiment between two git revisions on one benchmark")
    p.add_argument("--a", required=True, help="baseline revision")
    p.add_argument("--b", required=True, help="candidate revision")
    p.add_argument("--bench", required=True, help="benchmark name")
    p.add_argument("--rounds", type=int, default=8, help="interleaved A B A' rounds")
    p.add_argument("--runs", type=int, default=None, help="timed calls per subprocess run")
    p.add_argument("--repo", default=".", help="git repository")
    add_config_args(p, LoadConfig, only=("dtype", "device"))
    p.add_argument("--quick", action="store_true", help="small sizes, few runs")
    p.add_argument("--provider", action="append", default=[], help="extra module registering benchmarks")
    p.add_argument("--no-default-providers", action="store_true",
                   help="load only the --provider modules, not flashinfra's own")
    p.add_argument("--min-effect", type=float, default=0.02, help="smallest relative change worth a verdict")
    p.add_argument("--json", action="store_true", help="print the verdict and its figures as JSON")
    p.set_defaults(func=_cmd_ab)

    p = subparsers.add_parser("goals", help="acceptance criteria from a TOML goals file")
    sub = p.add_subparsers(dest="goals_command", required=True)
    s = sub.add_parser("check", help="evaluate every criterion; JSON verdict per criterion")
    s.add_argument("file")
    s.add_argument("--metrics", action="append", default=[], help="extra metric JSON file (repeatable)")
    s.set_defaults(func=_cmd_goals)
