import math

import pytest
import torch

from flashinfra.feedback import registry
from flashinfra.feedback.registry import compare, load_providers, poison_, register_check, select, tolerances


def test_compare_reports_figures_and_worst_element():
    ref = torch.randn(6, 9, dtype=torch.float64)
    out = ref.float().clone()
    out[4, 2] += 0.5
    r = compare("x", out, ref)
    assert not r.passed
    assert r.worst_index == (4, 2)
    assert r.max_abs == pytest.approx(0.5, rel=1e-5)
    assert r.num_bad == 1 and r.bad_indices == [(4, 2)] and r.bad_extent == [(4, 4), (2, 2)]
    assert r.rel_norm == pytest.approx(0.5 / float(ref.norm()), rel=1e-4)
    assert "worst[4, 2]" in r.summary()


def test_compare_passes_within_dtype_tolerance_and_fails_beyond():
    ref = torch.randn(100, dtype=torch.float64) + 3
    assert compare("bf16", ref.bfloat16(), ref).passed
    assert not compare("bf16 as fp32", ref.bfloat16(), ref, dtype=torch.float32).passed
    atol, rtol = tolerances(torch.bfloat16)
    assert (atol, rtol) == tolerances("bfloat16")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_output_never_passes(bad):
    ref = torch.zeros(3, 4, dtype=torch.float64)
    out = torch.zeros(3, 4)
    out[1, 3] = bad
    r = compare("x", out, ref, atol=1e30, rtol=1e30)
    assert not r.passed and r.num_nonfinite == 1 and r.worst_index == (1, 3) and math.isinf(r.max_abs)


def test_shape_mismatch_and_nonfinite_reference_fail():
    assert "shape mismatch" in compare("x", torch.zeros(3), torch.zeros(4, dtype=torch.float64)).message
    ref = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    r = compare("x", torch.tensor([1.0, 2.0]), ref)
    assert not r.passed and "reference" in r.message


def test_poison_fills_nan_and_int_min():
    assert torch.isnan(poison_(torch.zeros(3))).all()
    assert (poison_(torch.zeros(2, dtype=torch.int32)) == torch.iinfo(torch.int32).min).all()


def test_duplicate_registration_from_another_function_is_an_error():
    @register_check("test.registry.dup")
    def first():
        return compare("a", torch.zeros(1), torch.zeros(1, dtype=torch.float64))

    def second():
        return first()

    with pytest.raises(ValueError, match="already registered"):
        register_check("test.registry.dup")(second)


def test_select_by_prefix_glob_and_tag():
    table = {n: registry.Entry(n, lambda: None, tags, "m") for n, tags in
             [("a.b", ("kernel",)), ("a.bc", ()), ("c", ("kernel",))]}
    assert [e.name for e in select(table, ["a.b"])] == ["a.b"]
    assert [e.name for e in select(table, ["a.*"])] == ["a.b", "a.bc"]
    assert [e.name for e in select(table, ["kernel"])] == ["a.b", "c"]
    with pytest.raises(KeyError):
        select(table, ["nope"])


def test_load_providers_reports_absent_and_broken_modules(tmp_path, monkeypatch):
    (tmp_path / "broken_provider_mod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_provider_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    errors = load_providers(("flashinfra.no_such_pkg.checks", "broken_provider_mod", "raising_provider_mod"))
    assert [m for m, _ in errors] == ["flashinfra.no_such_pkg.checks", "broken_provider_mod", "raising_provider_mod"]
    assert "no_such_pkg" in errors[0][1] and "no_such_dependency_xyz" in errors[1][1] and "boom" in errors[2][1]


def test_builtin_providers_import_cleanly():
    assert load_providers() == []
    assert "kda.prefill" in registry.checks() and "kda.decode" in registry.benchmarks()
