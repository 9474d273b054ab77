"""bench/sass_count.py: kernels compiled for sm_90 without a GPU, counted."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sass_count.py"


@pytest.fixture(scope="module")
def sass_count():
    spec = importlib.util.spec_from_file_location("sass_count", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mask_free_blocks_compile_shorter(sass_count):
    """The bare bf16 decode program ([K, 64] on 4 warps, sums on the tensor cores) with its blocks read and
    written without masks (EVEN) is shorter than with them, and both use the tensor cores."""
    got = {}
    for even in (True, False):
        compiled, fn = sass_count.compile_sm90("decode", {"EVEN": even}, num_warps=4, maxnreg=None)
        got[even] = sass_count.count(compiled, fn, lines=True)
    assert 0 < got[True]["instructions"] < got[False]["instructions"]
    assert all(r["opcodes"].get("HMMA", 0) > 0 for r in got.values())
    assert all(0 < r["registers"] <= 255 and r["lines"] for r in got.values())


def test_prefill_state_pass_fits_an_sm(sass_count):
    """The prefill's state pass at the launcher's shape (the bf16x3 chain, value blocks of 64, a ring of two stages of
    tiles by the copy engine, the next step's tiles asked of the L2) compiles for sm_90 within an SM's 227 KB of
    shared memory, on the warpgroup products, with its three bulk L2 prefetches, and so does its ``u_in_state`` form:
    a change that outgrows it fails here, on a CPU, before it fails to launch on a GPU."""
    compiled, fn = sass_count.compile_sm90("state", {"L2_AHEAD": 1}, num_warps=4, maxnreg=None, num_stages=2)
    res = sass_count.count(compiled, fn, lines=False)
    assert 200_000 < res["shared_bytes"] <= 232_448
    assert res["opcodes"].get("HGMMA", 0) >= 20 and res["registers"] <= 255
    assert res["opcodes"].get("UBLKPF", 0) == 3
    # forming u from v and Aib (u_in_state): Aqk's lo half gives way, and the ring fits
    compiled, fn = sass_count.compile_sm90("state_u", {}, num_warps=4, maxnreg=None, num_stages=2)
    res = sass_count.count(compiled, fn, lines=False)
    assert 200_000 < res["shared_bytes"] <= 232_448 and res["opcodes"].get("HGMMA", 0) >= 20


@pytest.mark.parametrize("preset", ["intra_b", "intra_b_u"])
def test_prefill_tiles_kernel_fits_three_programs_per_sm(sass_count, preset):
    """Kernel B (the per-chunk tiles) at the launcher's shape and register cap (168), forming u or leaving it to the
    state pass (``u_in_state``, the default), compiles for sm_90 without spills, on the warpgroup products, its
    tiles by the copy engine, within a third of an SM's registers and shared memory: three programs per SM, which
    its time on an H200 was measured at."""
    compiled, fn = sass_count.compile_sm90(preset, {}, num_warps=4, maxnreg=168, num_stages=1)
    res = sass_count.count(compiled, fn, lines=False)
    assert res["stack_bytes"] == 0 and res["registers"] * 128 * 3 <= 65536
    assert 3 * res["shared_bytes"] <= 232_448
    assert res["opcodes"].get("HGMMA", 0) > 0 and res["opcodes"].get("UTMALDG", 0) > 0


def test_prefill_diagonal_kernel_fits_eight_programs_per_sm_capped(sass_count):
    """Kernel D (the in-chunk diagonal blocks, and the state pass's qg and kd) without Aqk's lo half, as
    ``u_in_state`` runs it, takes more than 128 registers uncapped (six programs per SM) and, capped at 128
    (``d_maxnreg``, the launcher's), compiles for sm_90 on its two warps with a few spilled values (8 bytes with
    Triton 3.6, 40 with 3.9): eight programs per SM by registers."""
    compiled, fn = sass_count.compile_sm90("intra_d", {"A_LO": 0}, num_warps=2, maxnreg=None, num_stages=1)
    assert sass_count.count(compiled, fn, lines=False)["registers"] > 128
    compiled, fn = sass_count.compile_sm90("intra_d", {"A_LO": 0}, num_warps=2, maxnreg=128, num_stages=1)
    res = sass_count.count(compiled, fn, lines=False)
    assert res["stack_bytes"] <= 64 and res["registers"] * 64 * 8 <= 65536
    assert res["opcodes"].get("HMMA", 0) > 0
