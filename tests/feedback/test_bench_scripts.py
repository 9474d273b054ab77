"""Every script in ``bench/`` compiles: they run only on the GPU machine, where a syntax error costs a whole device
call before anything is measured."""

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_compiles(script):
    source = (BENCH / script).read_text()
    compile(source, str(BENCH / script), "exec")
