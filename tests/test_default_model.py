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


def _load_training_kda():
    """``train/kda_chunk.py`` (the KDA the default model was trained with); it is not part of the package."""
    import importlib.util

    source = Path(__file__).resolve().parent.parent / "train" / "kda_chunk.py"
    spec = importlib.util.spec_from_file_location("kda_chunk", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.chunk_kda


def _kda_recurrence_f64(q, k, v, g, beta, state):
    """Token-by-token KDA in float64: S <- diag(exp g_t) S; S += k_t beta_t (v_t - S^T k_t); o_t = S^T q_t."""
    import torch

    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]  # [B, H, K, V]
        kv = (state * k[:, t][..., None]).sum(-2)  # [B, H, V]
        state = state + k[:, t][..., None] * ((v[:, t] - kv) * beta[:, t][..., None])[..., None, :]
        outs.append((state * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, dim=1), state


def test_training_kda_matches_a_float64_recurrence_values_and_gradients():
    import torch

    chunk_kda = _load_training_kda()
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 37, 3, 8, 5  # T not a multiple of the chunk: the padded tail is exercised
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    gate = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=g, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    s0 = torch.randn(B, H, K, V, generator=g, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, gate, beta)]
    out, state = chunk_kda(*inputs, chunk_size=16, initial_state=s0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = _kda_recurrence_f64(*inputs, s0)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * w).sum(), inputs)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
