"""Help text helpers shared by the command lines: every option shows its default, docstrings lose their
reST markup (``x`` -> x) before they are printed."""

from __future__ import annotations

import argparse
import re


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless it already says its default; flags that are
    off by default and options without a default say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action.default, list) and not action.default:
            return text
        return f"{text} (default: %(default)s)".strip()


def plain(doc: str) -> str:
    """reST inline markup -> plain text: ``code`` -> code, *em* stays."""
    return re.sub(r"``([^`]+)``", r"\1", doc)
