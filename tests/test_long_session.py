"""A long multi-turn chat session on the built-in model, greedy: each turn is the whole conversation so far through
the chat template, its answer appended to the next. With everything that carries state across turns on (prefix
hits restoring KDA checkpoints every 64 tokens, prefill chunked at 64 tokens, MTP drafts of 3), every turn's tokens
equal those of the reference path, which recomputes every turn cold in one step without drafts: a state restored or
folded wrongly shows as a drifting or degenerating answer some turns in."""

from __future__ import annotations

import importlib
import inspect

import flashinfra
from flashinfra import SamplingParams
from flashinfra.model.factory import default_model_dir
from flashinfra.server.tokenizer import Tokenizer

# each turn quotes a stdlib module's documentation (long turns are cheap prefill; the answers' decode steps are not)
MODULES = ["json", "random", "collections", "itertools", "string", "re", "argparse", "heapq", "csv"]
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=2, num_blocks=512, block_size=16)


def _session(llm, tok: Tokenizer) -> tuple[list[list[int]], list[int]]:
    """Every turn's tokens, and every turn's prompt length."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    messages, answers, lengths = [], [], []
    for name in MODULES:
        doc = inspect.getdoc(importlib.import_module(name))[:500]
        messages.append({"role": "user", "content": f"What does this say?\n\n{doc}"})
        ids = tok.encode_chat(messages)
        out = llm.generate([ids], params)[0]
        messages.append({"role": "assistant", "content": out.text})
        answers.append(out.token_ids)
        lengths.append(len(ids))
    return answers, lengths


def test_long_multi_turn_session_equals_the_cold_reference_path():
    tok = Tokenizer(default_model_dir())
    reference = flashinfra.LLM(str(default_model_dir()), prefix_cache_slots=0, max_num_batched_tokens=4096, **ENGINE)
    want, lengths = _session(reference, tok)
    reference.engine.close()
    llm = flashinfra.LLM(str(default_model_dir()), prefix_checkpoint_interval=64, max_num_batched_tokens=64,
                         speculative_tokens=3, **ENGINE)
    try:
        got, _ = _session(llm, tok)
        stats = llm.engine.stats()
        assert stats.num_prefix_hit_tokens_total >= sum(lengths[1:]) // 2  # most of each later turn came from the cache
    finally:
        llm.engine.close()
    assert lengths[-1] > 1000  # long enough for many checkpoints, each later turn's prefill in several chunks
    for turn, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"turn {turn} differs from the reference path"
