"""The ``flashinfra`` command line: one sub-command per concern, each registered by its own package.

Each module in ``COMMAND_MODULES`` exposes ``register(subparsers)``, which adds its sub-commands and sets
``func`` on them. Registration must stay cheap (no torch import at module level), so ``flashinfra
--help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "flashinfra.generate",
    "flashinfra.feedback.cli",
    "flashinfra.server.cli",
    "flashinfra.agent.cli",
    "flashinfra.eval.cli",
    "flashinfra.quant.cli",
    "flashinfra.parallel.plan",
    "flashinfra.server.router",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashinfra", description="Inference engine for GLM-5.3-Flash.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every sub-command's help shows each option's default."""
    from flashinfra.cli_help import DefaultsHelpFormatter

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if sub.formatter_class is argparse.HelpFormatter:
                    sub.formatter_class = DefaultsHelpFormatter
                _show_defaults(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
