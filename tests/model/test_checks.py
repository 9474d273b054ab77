"""The model registers its logits checks with flashinfra.feedback, and they run."""

from __future__ import annotations

from flashinfra.feedback.registry import checks, load_providers, select


def test_model_checks_registered_and_packed_passes():
    load_providers()
    model_checks = {c.name: c for c in select(checks(), ["model"])}
    assert {"model.logits.prefill", "model.logits.decode", "model.logits.packed"} <= set(model_checks)
    result = model_checks["model.logits.packed"].fn()
    assert result.passed and result.max_abs < 1e-4, result
