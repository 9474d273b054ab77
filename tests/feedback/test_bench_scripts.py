"""Every script in ``bench/`` compiles: they run only on the GPU machine, where a syntax error costs a whole device
call before anything is measured."""

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_compiles(script):
    source = (BENCH / script).read_text()
    compile(source, str(BENCH / script), "exec")


def test_profile_diff_names_what_changed(monkeypatch):
    """``hotpath_profile.py --diff``: a kernel gone, one new, one slower, one unchanged (left out), per matched step."""
    monkeypatch.syspath_prepend(str(BENCH))
    from hotpath_profile import diff

    def run(kernels, b2b, digest):
        return {"steps": [{"batch": 1, "context": 4096, "chunk": 0, "back_to_back_us": b2b, "kernel_sum_us": b2b,
                           "kernels_per_step": len(kernels), "logits_digest": digest,
                           "kernels": [{"name": n, "us_per_step": us, "calls_per_step": c} for n, us, c in kernels]}]}

    before = run([("mix", 30.0, 8), ("post", 20.0, 8), ("gemm", 400.0, 4)], 1000.0, [1.0, 2.0])
    after = run([("post", 35.0, 8), ("gemm", 400.5, 4), ("fused", 3.0, 1)], 980.0, [1.0, 2.0])
    lines = diff(before, after).splitlines()
    assert lines[0].startswith("B=1 context 4096 chunk 0: back-to-back 1000 -> 980 us") and "logits same" in lines[0]
    named = [line.split()[-1] for line in lines[1:]]
    assert named == ["mix", "fused", "post"], lines  # largest gain first; the unchanged GEMM left out
    assert "calls 8 -> 0" in lines[1]
    after["steps"][0]["back_to_back_range_us"] = [960.4, 1010.2]  # kept by runs since: the timings' spread
    assert "back-to-back 1000 -> 980 (960-1010) us" in diff(before, after).splitlines()[0]
