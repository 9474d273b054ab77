"""Progress bars for long work (model load, evaluation, benchmarks): one ``tqdm`` bar on stderr.

A bar shows when stderr is a terminal, or when the caller asks for it (``enabled=True``); ``enabled=False``
hides it whatever stderr is. Logs and pipes therefore never receive carriage-return noise by default.
"""

from __future__ import annotations

import sys


def progress_bar(total: int, desc: str, unit: str, enabled: bool | None = None):
    """A ``tqdm`` bar over ``total`` units (``update(n)``, ``set_postfix_str``, ``close()``); disabled, it
    accepts the same calls and prints nothing."""
    from tqdm import tqdm

    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not show, leave=False,
                dynamic_ncols=True)
