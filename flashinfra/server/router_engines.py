"""The router's engines: what it knows of each (``Backend``), and the start-up check that they fit together
(``discover``): every server has the role it was given, and every prefill engine's transfer backend and cache
layout match every decode engine's (a message naming both engines and the differences otherwise)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec

from flashinfra.disagg.layout import CacheLayout, check_compatible


@dataclass
class Backend:
    url: str
    role: str
    transfer_address: str = ""
    layout: dict | None = None
    transfer_backend: str = "zmq"
    model: str = ""
    in_flight: int = 0
    num_requests: int = 0
    num_failures: int = 0


async def discover(client, backends: list[Backend], timeout_s: float) -> None:
    """Fill in each backend's info (waiting up to ``timeout_s`` for it to answer); ``ValueError`` when a role
    or a cache layout does not fit."""
    deadline = time.monotonic() + timeout_s
    for b in backends:
        while True:
            try:
                r = await client.get(f"{b.url}/disagg/info", timeout=5.0)
                if r.status_code == 200:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise ValueError(f"{b.url} did not answer /disagg/info within {timeout_s:g} s")
            await asyncio.sleep(0.2)
        info = r.json()
        if info["role"] != b.role:
            raise ValueError(f"{b.url} is a {info['role']!r} server, given as --{b.role}")
        b.transfer_address, b.layout, b.model = info["transfer_address"], info["cache_layout"], info["model"]
        b.transfer_backend = info.get("transfer_backend", "zmq")
    for p in (b for b in backends if b.role == "prefill"):
        for d in (b for b in backends if b.role == "decode"):
            if p.transfer_backend != d.transfer_backend:
                raise ValueError(f"prefill {p.url} moves cache bytes with --transfer-backend {p.transfer_backend}, "
                                 f"decode {d.url} with {d.transfer_backend}")
            mine = msgspec.convert({**p.layout, "name": f"prefill {p.url}"}, CacheLayout)
            theirs = msgspec.convert({**d.layout, "name": f"decode {d.url}"}, CacheLayout)
            check_compatible(mine, theirs)
