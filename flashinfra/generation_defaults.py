"""A checkpoint's default sampling settings, from its ``generation_config.json`` (as transformers and vLLM
read it): ``do_sample`` false means greedy; ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` become the defaults of every request that does not set
them (``flashinfra generate``, ``LLM.generate`` without sampling params, and the server's requests).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from flashinfra.engine.sched.messages import SamplingParams

_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_defaults(model_dir: str | Path) -> dict:
    """SamplingParams field -> default value; ``max_tokens`` from ``max_new_tokens``. Empty without a file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {name: raw[name] for name in _FIELDS if isinstance(raw.get(name), (int, float))}
    if raw.get("do_sample") is False:
        out["temperature"] = 0.0
        for name in ("top_p", "top_k", "min_p"):
            out.pop(name, None)
    if isinstance(raw.get("max_new_tokens"), int) and raw["max_new_tokens"] > 0:
        out["max_tokens"] = raw["max_new_tokens"]
    return out


def apply_defaults(params: SamplingParams, defaults: dict, explicit: set[str] | frozenset = frozenset(),
                   include_max_tokens: bool = False) -> SamplingParams:
    """``params`` with every default whose field is not in ``explicit`` (fields the user set)."""
    changes = {k: v for k, v in defaults.items() if k not in explicit and (k != "max_tokens" or include_max_tokens)}
    return msgspec.structs.replace(params, **changes) if changes else params
