"""Shared fixtures of the server tests: the tiny checkpoint's tokenizer (no engine needed)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from flashinfra.model.factory import write_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path, 512)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from flashinfra.server.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir)
