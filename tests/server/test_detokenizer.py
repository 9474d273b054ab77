"""Incremental detokenization and stop strings on the tiny checkpoint's byte-level BPE tokenizer."""

from __future__ import annotations

import random

import pytest

from flashinfra.server.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, wörld! The capital 日本 of France is Paris.",
    "Engines serve many requests at once, batching their tokens. 🚀🚀 done",
    "ab\ncd\n\nef — ü ß 漢字 x",
]


def stream(tokenizer, prompt_ids, ids, stop=(), include_stop=False, chunk_sizes=None):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop, include_stop)
    pieces, offsets = [], []
    rng = random.Random(len(ids))
    i = 0
    while i < len(ids) and not detok.stopped:
        size = chunk_sizes or rng.randint(1, 3)
        for token in ids[i:i + size]:
            offsets.append(detok.add_token(token))
        i += size
        pieces.append(detok.pop_delta())
    if not detok.stopped:
        detok.finish()
    pieces.append(detok.pop_delta(final=True))
    return detok, pieces, offsets


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("The quick brown fox")
    detok, pieces, offsets = stream(tokenizer, prompt, ids)
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert detok.text == text and not detok.stopped
    assert all("\ufffd" not in p for p in pieces), pieces  # a split character is never sent half-done
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 7])
def test_tokens_added_in_groups_give_the_same_text(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], ())
    pieces = []
    for i in range(0, len(ids), chunk):
        detok.add_tokens(ids[i:i + chunk])
        pieces.append(detok.pop_delta())
    detok.finish()
    pieces.append(detok.pop_delta(final=True))
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)
    assert detok.token_ids == ids
    assert all("\ufffd" not in p for p in pieces), pieces
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, [], ["x"]).add_tokens(ids)


def test_stop_string_spanning_tokens_is_cut_and_never_leaked(tokenizer):
    text = "The capital of France is Paris. Hello, world!"
    ids = tokenizer.encode(text)
    stop = "France is Par"
    # The stop string must really span several tokens for this test to mean anything.
    assert not any(stop in tokenizer.token_text(t) for t in ids)
    for chunk in (1, 2, 5):
        detok, pieces, _ = stream(tokenizer, [], ids, stop=[stop], chunk_sizes=chunk)
        assert detok.stopped and detok.stop_string == stop
        assert "".join(pieces) == "The capital of "
        assert all("Fr" not in p for p in pieces)


def test_include_stop_and_earliest_of_several(tokenizer):
    text = "Hello, world! How are you today?"
    ids = tokenizer.encode(text)
    detok, pieces, _ = stream(tokenizer, [], ids, stop=["today", "world"], include_stop=True)
    assert "".join(pieces) == "Hello, world"
    assert detok.stop_string == "world"


def test_held_back_text_is_released_when_no_stop_follows(tokenizer):
    ids = tokenizer.encode("Hello, world")
    detok = IncrementalDetokenizer(tokenizer, [], ["world peace"])
    sent = ""
    for t in ids:
        detok.add_token(t)
        sent += detok.pop_delta()
    assert sent == "Hello, "  # "world" could still become "world peace"
    detok.finish()
    assert sent + detok.pop_delta(final=True) == "Hello, world"
    assert not detok.stopped


def test_tokens_after_stop_are_ignored(tokenizer):
    ids = tokenizer.encode("one. two. three.")
    detok, pieces, _ = stream(tokenizer, [], ids, stop=["."], chunk_sizes=len(ids))
    assert "".join(pieces) == "one"
    before = detok.text
    detok.add_token(ids[0])
    assert detok.text == before and detok.pop_delta() == ""


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.encode("<|endoftext|>", add_special_tokens=False)
    assert len(eos) == 1 and eos[0] in tokenizer.special_ids
    ids = tokenizer.encode("Hello") + eos
    _, pieces, _ = stream(tokenizer, [], ids)
    assert "".join(pieces) == "Hello"


def test_empty_stop_string_is_refused(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], [""])


def test_chat_template_renders_and_reports_bad_templates(tokenizer_dir):
    from flashinfra.server.tokenizer import ChatTemplateError, Tokenizer

    tok = Tokenizer(tokenizer_dir)
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[:2] == tok.encode("[gMASK]<sop>", add_special_tokens=False)
    tok.chat_template = "{{ raise_exception('no system role') }}"
    tok._template = None
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.render_chat([{"role": "user", "content": "x"}])
