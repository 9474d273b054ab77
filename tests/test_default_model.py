"""The built-in default model: the small trained checkpoint shipped in ``flashinfra/assets/default-model``.

It must stay small, keep every layer kind of the release, carry GLM's tokenizer format, be far better than
a random model of the same architecture on held-out text, and continue a plain prompt in English.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2

import flashinfra
from flashinfra.cli import main
from flashinfra.config import load_config
from flashinfra.eval.perplexity import perplexity
from flashinfra.model.factory import default_model_dir, write_tiny_checkpoint

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SLICE = Path(__file__).parent / "eval" / "data" / "heldout-slice.txt"
TRAINING_CONTEXT = 512  # train/train_model.py CONTEXT


def test_default_model_is_the_shipped_checkpoint_and_small():
    path = default_model_dir()
    assert path == Path(flashinfra.__file__).parent / "assets" / "default-model"
    assert all((path / f).is_file() for f in FILES)
    assert sum((path / f).stat().st_size for f in FILES) <= 16 * 10**6


def test_every_layer_kind_of_the_release_is_present():
    t = load_config(default_model_dir()).text
    assert {"linear_attention", "indexed_attention"} <= set(t.layer_types)
    assert [i for i, k in enumerate(t.layer_types) if k == "indexed_attention"] == [3, 7]
    assert "full" in [t.indexer_types[i] for i in (3, 7)]
    assert t.index_kpool == 4
    assert t.index_topk < TRAINING_CONTEXT  # so that the indexer's selection mattered in training
    assert t.mlp_layer_types[0] == "dense" and set(t.mlp_layer_types[1:]) == {"sparse"}
    assert t.n_routed_experts >= 8 and 2 <= t.num_experts_per_tok < t.n_routed_experts
    assert t.hc_mult == 4


def test_tokenizer_and_chat_template_follow_the_release_format():
    from tokenizers import Tokenizer

    path = default_model_dir()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    t = load_config(path).text
    assert tok.get_vocab_size() == t.vocab_size
    special = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    ids = {s: tok.token_to_id(s) for s in special}
    assert None not in ids.values()
    assert set(t.eos_token_id) == {ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]}
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == list(t.eos_token_id)
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    assert text == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHello<|assistant|>"
    encoded = tok.encode(text).ids
    assert encoded[:2] == [ids["[gMASK]"], ids["<sop>"]] and encoded[-1] == ids["<|assistant|>"]


def test_trained_model_is_far_better_than_a_random_one_on_heldout_text(tmp_path):
    from tokenizers import Tokenizer

    path = default_model_dir()
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(SLICE.read_text(encoding="utf-8")).ids[:256]
    text_config = json.loads((path / "config.json").read_text())["text_config"]
    arch = {k: v for k, v in text_config.items() if k not in ("model_type", "dtype", "transformers_version")}
    random_dir = write_tiny_checkpoint(tmp_path / "random", seed=0, tokenizer=False, **arch)
    trained = perplexity(flashinfra.load_model(path), ids, window=256).perplexity
    random = perplexity(flashinfra.load_model(random_dir), ids, window=256).perplexity
    assert trained < random / 10, (trained, random)
    assert trained < 400, trained


COMMON_WORDS = {"the", "and", "of", "to", "a", "in", "that", "is", "he", "his", "unto", "lord", "shall", "for",
                "it", "be", "with", "not", "they", "i", "was", "thou", "said", "god", "all", "them", "him"}


def test_generate_continues_a_plain_prompt_in_english(capsys):
    prompt = "And God said"
    assert main(["generate", "--max-tokens", "8", "--device", "cpu", prompt]) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt)
    words = re.findall(r"[A-Za-z]+", out[len(prompt) :])
    assert len(words) >= 3, out
    assert len({w.lower() for w in words} & COMMON_WORDS) >= 2, out
