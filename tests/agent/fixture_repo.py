"""A throwaway git repository with three planted problems, registered with ``flashinfra.feedback`` the
way any repository does, for the Infra Agent's acceptance tests.

- ``engine/transfer.py``: the KV-transfer thread checksums each page with ``sum(bytes)``, one C call that
  holds the GIL for milliseconds and stalls the prefill thread (signal: the GIL probe and the
  ``prefill_with_transfer / prefill_alone`` criterion). The fix computes the same sum with a numpy
  reduction, which releases the GIL.
- ``engine/rowsum.py``: a per-row Python loop (signal: ``kernel.rowsum`` is far slower than copying the
  same tensor). The fix is one vectorised reduction.
- ``engine/scan.py``: a chunked running sum whose carry between chunks is stored in bfloat16; exact for
  one chunk, wrong beyond it (signal: the ``scan.long`` check fails, ``scan.short`` passes).

``FIXES`` holds, per problem, the correct fix, a fast fix that breaks correctness and a no-op, each as
(path, old text, new text) for the ``edit_file`` tool.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

FILES = {
    "engine/__init__.py": '"""A toy serving engine with three performance and accuracy problems."""\n',
    "engine/prefill.py": '''
        """Prefill: many small ops, each releasing the GIL while it computes."""
        import torch


        def prefill(x, w, layers=7500):
            h = x
            for _ in range(layers):
                h = torch.tanh(h @ w)
            return h
        ''',
    "engine/transfer.py": '''
        """Moves cache pages to a peer on a background thread, with a checksum per page."""
        import threading
        import time

        import torch

        WIRE_S = 0.001  # time on the wire per page; the thread sleeps (GIL released) meanwhile


        def checksum(page: torch.Tensor) -> int:
            """Sum of the page's bytes; the receiver recomputes it to detect torn pages."""
            return sum(page.numpy().tobytes())


        class Transfer(threading.Thread):
            def __init__(self, pages):
                super().__init__(name="kv-transfer", daemon=True)
                self.pages = pages
                self.received = []
                self.sums = []

            def run(self):
                for page in self.pages:
                    time.sleep(WIRE_S)
                    self.received.append(page.clone())
                    self.sums.append(checksum(page))
        ''',
    "engine/rowsum.py": '''
        """Row sums of a [R, C] float32 matrix."""
        import torch


        def rowsum(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(x.shape[0], dtype=x.dtype)
            for i in range(x.shape[0]):
                out[i] = x[i].sum()
            return out
        ''',
    "engine/scan.py": '''
        """Running sum over the sequence, one chunk at a time with a carry between chunks."""
        import torch

        CHUNK = 256


        def chunked_cumsum(x: torch.Tensor) -> torch.Tensor:
            T, D = x.shape
            out = torch.empty_like(x)
            carry = torch.zeros(D, dtype=torch.bfloat16)
            for s in range(0, T, CHUNK):
                block = torch.cumsum(x[s:s + CHUNK], 0) + carry
                out[s:s + CHUNK] = block
                carry.copy_(block[-1])
            return out
        ''',
    "engine/checks.py": '''
        """The engine's checks and benchmarks, registered with flashinfra.feedback."""
        import torch

        from flashinfra.feedback.registry import BenchSpec, compare, register_benchmark, register_check
        from engine.prefill import prefill
        from engine.rowsum import rowsum
        from engine.scan import chunked_cumsum
        from engine.transfer import Transfer

        torch.set_num_threads(1)  # the toy engine runs one op at a time; timings stay comparable


        # four 2 MB pages: the GIL-holding checksum adds about 100 ms to a 57 ms prefill, far above the noise of a
        # busy two-core machine (A/A noise floors of 30-48% were seen there)
        def _pages(seed, n=4, numel=512 * 1024):
            g = torch.Generator().manual_seed(seed)
            return [torch.randn(numel, generator=g) for _ in range(n)]


        @register_check("transfer.roundtrip")
        def check_transfer():
            pages = _pages(1234)
            t = Transfer(pages)
            t.start()
            t.join()
            ref_sums = torch.tensor([sum(p.numpy().tobytes()) for p in pages])
            return [compare("transfer.pages", torch.stack(t.received), torch.stack(pages), atol=0, rtol=0),
                    compare("transfer.checksums", torch.tensor(t.sums), ref_sums)]


        @register_check("kernel.rowsum")
        def check_rowsum():
            x = torch.randn(333, 517)
            return compare("kernel.rowsum.out", rowsum(x), x.double().sum(1), dtype=torch.float32)


        def _scan(name, T):
            x = torch.rand(T, 33)
            return compare(name, chunked_cumsum(x), torch.cumsum(x.double(), 0), dtype=torch.float32)


        @register_check("scan.short")
        def check_scan_short():
            return _scan("scan.short.out", 201)


        @register_check("scan.long")
        def check_scan_long():
            return _scan("scan.long.out", 20011)


        def _prefill_inputs(seed):
            g = torch.Generator().manual_seed(seed)
            return torch.randn(16, 64, generator=g), torch.randn(64, 64, generator=g) / 8, _pages(seed)


        @register_benchmark("prefill_alone")
        def bench_prefill_alone(ctx):
            return BenchSpec(fn=lambda x, w, pages: prefill(x, w), make_inputs=_prefill_inputs)


        def _prefill_with_transfer(x, w, pages):
            t = Transfer(pages)
            t.start()
            out = prefill(x, w)
            t.join()
            return out


        @register_benchmark("prefill_with_transfer")
        def bench_prefill_with_transfer(ctx):
            return BenchSpec(fn=_prefill_with_transfer, make_inputs=_prefill_inputs)


        def _matrix(seed):  # tall and narrow: the per-row loop is ~300x a copy, far from the 10x criterion
            return (torch.randn(8192, 128, generator=torch.Generator().manual_seed(seed)),)


        @register_benchmark("kernel.rowsum")
        def bench_rowsum(ctx):
            return BenchSpec(fn=rowsum, make_inputs=_matrix, bytes=1024 * 1024 * 4)


        @register_benchmark("kernel.copy")
        def bench_copy(ctx):
            return BenchSpec(fn=torch.clone, make_inputs=_matrix, bytes=2 * 1024 * 1024 * 4)
        ''',
}

GOALS = {
    "transfer": '''
        [campaign]
        name = "transfer"
        goal = "Prefill must not slow down while the KV-transfer thread runs."
        providers = ["engine.checks"]
        [evaluation]
        checks = ["transfer", "kernel", "scan.short"]
        benchmarks = ["prefill_alone", "prefill_with_transfer"]
        rounds = 2
        repeats = 5
        [[target]]
        metric = "prefill_with_transfer"
        direction = "lower"
        [[criterion]]
        # 25%, not 5%: with the GIL released the thread still shares a busy two-core machine's cores; the fixed
        # transfer measured 1.06-1.18 there
        name = "transfer overhead at most 25%"
        expr = "prefill_with_transfer / prefill_alone <= 1.25"
        [guardrails]
        editable = ["engine/**"]
        read_only = ["goals/**"]
        [budgets]
        iterations = 30
        wall_time_s = 600
        tokens = 200000
        [sandbox]
        timeout_s = 60
        ''',
    "kernel": '''
        [campaign]
        name = "kernel"
        goal = "kernel.rowsum must run within 10x the time of copying its input."
        providers = ["engine.checks"]
        [evaluation]
        checks = ["transfer", "kernel", "scan.short"]
        benchmarks = ["kernel.rowsum", "kernel.copy"]
        rounds = 2
        repeats = 5
        # the fix is ~100x faster than the planted loop (a 0.99 change): only a 2x gain counts, which no no-op
        # reaches by drift on a busy machine (A/A noise floors of 30-48% were seen there)
        min_effect = 0.5
        [[target]]
        metric = "kernel.rowsum"
        direction = "lower"
        [[criterion]]
        # the loop is ~300x a copy, the fix ~2x: both far from the bound, whatever the load
        name = "rowsum within 10x of copy"
        expr = "kernel.rowsum / kernel.copy <= 10"
        [guardrails]
        editable = ["engine/**"]
        read_only = ["goals/**"]
        [budgets]
        iterations = 30
        wall_time_s = 600
        tokens = 200000
        [sandbox]
        timeout_s = 60
        ''',
    "precision": '''
        [campaign]
        name = "precision"
        goal = "chunked_cumsum must keep float32 accuracy at long sequence lengths."
        providers = ["engine.checks"]
        [evaluation]
        checks = []
        benchmarks = []
        [[target]]
        metric = "scan.long.out.rel_norm"
        direction = "lower"
        [[criterion]]
        name = "long-sequence error"
        expr = "scan.long.out.rel_norm <= 1e-6"
        [guardrails]
        editable = ["engine/**"]
        read_only = ["goals/**"]
        [budgets]
        iterations = 30
        wall_time_s = 600
        tokens = 200000
        [sandbox]
        timeout_s = 60
        ''',
}

FIXES = {
    "transfer": {
        "correct": ("engine/transfer.py", "return sum(page.numpy().tobytes())",
                    "return int(page.numpy().view(\"uint8\").sum(dtype=\"int64\"))"),
        "breaks": ("engine/transfer.py", "return sum(page.numpy().tobytes())", "return 0"),
        "noop": ("engine/transfer.py", "self.sums = []", "self.sums = list()"),
    },
    "kernel": {
        "correct": ("engine/rowsum.py", "out = torch.empty(x.shape[0], dtype=x.dtype)\n"
                    "    for i in range(x.shape[0]):\n        out[i] = x[i].sum()\n    return out",
                    "return x.sum(dim=1)"),
        "breaks": ("engine/rowsum.py", "out = torch.empty(x.shape[0], dtype=x.dtype)\n"
                   "    for i in range(x.shape[0]):\n        out[i] = x[i].sum()\n    return out",
                   "return x.to(torch.bfloat16).sum(dim=1).float()"),
        "noop": ("engine/rowsum.py", "for i in range(x.shape[0]):", "for i in range(len(x)):"),
    },
    "precision": {
        "correct": ("engine/scan.py", "carry = torch.zeros(D, dtype=torch.bfloat16)",
                    "carry = torch.zeros(D, dtype=torch.float32)"),
        "breaks": ("engine/scan.py", "carry.copy_(block[-1])", "carry.copy_(block[0])"),
        "noop": ("engine/scan.py", "CHUNK = 256", "CHUNK = 256  # rows per chunk"),
    },
}


def write_repo(root: Path) -> Path:
    """Create the fixture repository at ``root`` (one commit) and return it."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    for name, text in GOALS.items():
        path = root / "goals" / f"{name}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    (root / ".gitignore").write_text("__pycache__/\n", encoding="utf-8")
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"],
                 ["git", "-c", "user.name=Fixture", "-c", "user.email=fixture@example.invalid", "commit", "-q",
                  "-m", "toy engine"]):
        subprocess.run(argv, cwd=root, check=True, capture_output=True)
    return root
