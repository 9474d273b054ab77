"""The pipelined kernels compiled for sm_90 (no GPU needed) hold no tile that a register load and an asynchronous
tensor-core product both read from one multi-buffered shared-memory allocation: Triton's pipeliner sizes such an
allocation for the register load alone, and the copy two steps ahead then overwrites the tile under the running
product (``bench/kernel_resources.py``'s ``mma_buffer_hazards``; it gave wrong mHC weights for some tokens of a bf16
prompt). The detector itself is checked on a kernel written the way that failed."""

import subprocess
import sys
from pathlib import Path

import pytest
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
kernel_resources = pytest.importorskip("kernel_resources")


@triton.jit
def _squares_and_product(x, w, out, ss, K, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The failing form: one loaded tile read by the sum of squares (registers) and by the MMA (shared memory)."""
    o_t, o_n = tl.arange(0, BT), tl.arange(0, BN)
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    sq = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        b_x = tl.load(x + o_t[:, None] * K + o_k[None, :])
        b_w = tl.load(w + o_n[None, :] * K + o_k[:, None])
        sq += tl.sum(b_x.to(tl.float32) * b_x.to(tl.float32), 1)
        acc += tl.dot(b_x, b_w)
    tl.store(out + o_t[:, None] * BN + o_n[None, :], acc)
    tl.store(ss + o_t, sq)


def test_the_detector_finds_the_failing_form():
    spec = kernel_resources._spec("-", "-", dict(x="*bf16", w="*bf16", out="*fp32", ss="*fp32", K="i32"),
                                  dict(BT=64, BN=32, BK=128), ("K",), 4, 3, "failing form")
    assert kernel_resources.compile_kernel(_squares_and_product, spec)["buffer_hazards"]


def test_no_kernel_reads_a_pipelined_tile_from_registers_and_an_async_mma():
    run = subprocess.run([sys.executable, str(REPO / "bench/kernel_resources.py"), "--hazards"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
