"""The server's registered feedback check passes on the built-in default model's tokenizer."""

from __future__ import annotations


def test_detokenizer_check_passes():
    from flashinfra.server.checks import check_detokenizer

    results = check_detokenizer()
    assert [r.name for r in results] == ["server.detokenizer.stream", "server.detokenizer.stop"]
    assert all(r.passed and r.num_bad == 0 for r in results), [r.message for r in results]
