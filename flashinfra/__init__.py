"""flashinfra: an inference engine for GLM-5.3-Flash.

Public entry points are imported lazily so that ``import flashinfra`` (and the CLI's ``--help``) stays
fast and torch-free until a model is needed.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load_model": ("flashinfra.model.api", "load_model"),
    "LLM": ("flashinfra.llm", "LLM"),
    "SamplingParams": ("flashinfra.engine.sched.messages", "SamplingParams"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'flashinfra' has no attribute {name!r}")


__all__ = list(_LAZY)
