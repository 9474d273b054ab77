"""Measured machine ceilings for the roofline: memory copy bandwidth and matmul rate, on this device.

``flashinfra bench ceilings`` measures them and stores them under ``env.cache_dir()/ceilings/`` keyed by
host and device name, so ``flashinfra bench NAME`` reports each benchmark as a fraction of what the same
machine was measured to do (not of a datasheet). Timing: CUDA events after a synchronize on the GPU,
``perf_counter`` on the CPU; the best of several repetitions, as a ceiling is the most the machine does.
"""

from __future__ import annotations

import json
import platform
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flashinfra import env


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def copy_numel(device: str, quick: bool) -> int:
    """Elements of the float32 copy: 1 GiB on the GPU (far beyond L2), 64 MiB on the CPU."""
    return (1 << 28 if device.startswith("cuda") else 1 << 24) >> (4 if quick else 0)


def matmul_size(device: str, quick: bool) -> int:
    return (8192 if device.startswith("cuda") else 1024) >> (1 if quick else 0)


def _best_seconds(fn, device: str, reps: int) -> float:
    import torch

    fn()  # warm-up: allocation, kernel selection
    best = float("inf")
    for _ in range(reps):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure(device: str = "cpu", quick: bool = False) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) and matmul FLOP/s for float32 and, on CUDA,
    bfloat16."""
    import torch

    cuda = device.startswith("cuda")
    src = torch.randn(copy_numel(device, quick), device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, reps=5 if quick else 20)
    result: dict[str, Any] = {"copy_bytes_per_s": 2 * src.numel() * src.element_size() / copy_s}
    del src, dst
    n = matmul_size(device, quick)
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        mm_s = _best_seconds(lambda: torch.mm(a, b), device, reps=3 if quick else 10)
        result[f"matmul_flops_per_s_{str(dtype).removeprefix('torch.')}"] = 2 * n**3 / mm_s
    result["matmul_flops_per_s"] = max(v for k, v in result.items() if k.startswith("matmul_flops_per_s_"))
    result.update(device=device, device_name=device_name(device), host=socket.gethostname(),
                  torch=torch.__version__, quick=quick, date=datetime.now(timezone.utc).isoformat())
    return result


def _path(device: str) -> Path:
    name = "".join(c if c.isalnum() else "_" for c in f"{socket.gethostname()}-{device_name(device)}")
    return env.cache_dir() / "ceilings" / f"{name}.json"


def save(ceilings: dict[str, Any]) -> Path:
    path = _path(ceilings["device"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ceilings, indent=2))
    return path


def load(device: str) -> dict[str, Any] | None:
    path = _path(device)
    return json.loads(path.read_text()) if path.exists() else None


def load_or_measure(device: str, quick: bool = False) -> dict[str, Any]:
    """The stored ceilings of this machine, measured (quick) and stored first when there are none."""
    found = load(device)
    if found is None:
        found = measure(device, quick=True)
        save(found)
    return found


def format_text(c: dict[str, Any]) -> str:
    lines = [f"ceilings of {c['device_name']} ({c['device']}) on {c['host']}, {c['date']}",
             f"  copy bandwidth  {c['copy_bytes_per_s'] / 1e9:10.1f} GB/s (read + write)"]
    for key, value in c.items():
        if key.startswith("matmul_flops_per_s_"):
            lines.append(f"  matmul {key.removeprefix('matmul_flops_per_s_'):9s}{value / 1e12:10.2f} TFLOP/s")
    return "\n".join(lines)
