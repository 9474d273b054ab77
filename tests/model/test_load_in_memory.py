"""``load_model_from_state_dict``: an in-memory transformers model -> ours, matched as strictly as on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flashinfra
from flashinfra.model.api import load_model_from_state_dict, model_config_from
from flashinfra.model.loader import CheckpointError, StateDictReader

from .hf_reference import build_hf_model, hf_logits, save, text_config

IDS = [[5, 17, 3, 99, 250, 7, 1, 42, 8, 11, 300, 12, 13], [9, 4, 200]]


@pytest.fixture(scope="module")
def hf_text():
    return build_hf_model(text_config(), seed=5, text_only=True)


@pytest.fixture(scope="module")
def saved(hf_text, tmp_path_factory) -> Path:
    return save(hf_text, tmp_path_factory.mktemp("hf_text"))


def test_text_model_state_dict_gives_the_saved_checkpoints_logits(hf_text, saved):
    sd = hf_text.state_dict()
    assert "layers.1.mlp.experts.gate_up_proj" in sd and "layers.0.attn_hc.fn" in sd  # in-memory names
    mem = load_model_from_state_dict(hf_text.config, sd)
    disk = flashinfra.load_model(saved)
    assert not mem.config.has_lm_head and mem.config.architecture == "Glm5NextTextModel"
    for a, b in zip(mem.logits(IDS), disk.logits(IDS)):
        assert torch.equal(a, b)
    ref = hf_logits(hf_text, IDS[0])
    assert (mem.logits(IDS[:1])[0] - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_conditional_generation_state_dict_keeps_vision_and_mtp_as_extra(tmp_path):
    hf = build_hf_model(text_config(), seed=6)
    sd = dict(hf.state_dict())
    n = text_config()["num_hidden_layers"]
    sd[f"model.language_model.layers.{n}.eh_proj.weight"] = torch.randn(4, 4)
    mem = load_model_from_state_dict(hf.config, sd, dtype="float32")
    assert mem.config.has_lm_head
    assert f"model.language_model.layers.{n}.eh_proj.weight" in mem.report.extra
    assert any(k.startswith("model.visual.") for k in mem.report.extra)
    assert all(v is None for v in mem.report.extra.values())
    disk = flashinfra.load_model(save(hf, tmp_path / "cg"))
    assert torch.equal(mem.logits(IDS)[0], disk.logits(IDS)[0])


def _release_tensors(saved: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((saved / "config.json").read_text()), load_file(str(saved / "model.safetensors"))


def _disk(raw: dict, tensors: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _mutations(t: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    missing = {k: v for k, v in t.items() if k != "layers.3.self_attn.indexer.wk.weight"}
    extra = {**t, "layers.2.mlp.experts.99.down_proj.weight": torch.zeros(2, 2)}
    bad = "layers.2.mlp.experts.0.down_proj.weight"
    misshaped = {**t, bad: t[bad][:, :-1].contiguous()}
    return dict(missing=missing, extra=extra, misshaped=misshaped)


@pytest.mark.parametrize("kind", ["missing", "extra", "misshaped"])
def test_bad_state_dict_fails_with_the_checkpoint_error(saved, tmp_path, kind):
    raw, tensors = _release_tensors(saved)
    bad = _mutations(tensors)[kind]
    with pytest.raises(CheckpointError) as on_disk:
        flashinfra.load_model(_disk(raw, bad, tmp_path / kind))
    with pytest.raises(CheckpointError) as in_memory:
        load_model_from_state_dict(raw, bad)
    assert str(in_memory.value) == str(on_disk.value)
    expected = {"missing": "missing: layers.3.self_attn.indexer.wk.weight",
                "extra": "unexpected: layers.2.mlp.experts.99.down_proj.weight",
                "misshaped": "mis-shaped: layers.2.mlp.experts.0.down_proj.weight: checkpoint [64, 31]"}[kind]
    assert expected in str(in_memory.value)


def test_bad_transformers_names_are_named_in_their_own_naming(hf_text):
    sd = dict(hf_text.state_dict())
    del sd["layers.1.mlp.experts.gate_up_proj"]
    del sd["layers.0.attn_hc.fn"]
    del sd["layers.2.self_attn.q_proj.weight"]
    sd["layers.0.self_attn.o_proj.weight"] = sd["layers.0.self_attn.o_proj.weight"][:-1]
    sd["layers.0.self_attn.surprise"] = torch.zeros(3)
    with pytest.raises(CheckpointError) as info:
        load_model_from_state_dict(hf_text.config, sd)
    msg = str(info.value)
    assert "(or instead: layers.1.mlp.experts.gate_up_proj)" in msg
    assert "missing: layers.0.hc_attn_fn (or instead: layers.0.attn_hc.fn)" in msg
    assert "mis-shaped: layers.0.self_attn.o_proj.weight: checkpoint [63, 64], model expects [64, 64]" in msg
    assert "unexpected: layers.0.self_attn.surprise" in msg
    # the rest of the fused in_proj is expected, not unexpected: only the absent piece is reported
    assert "missing: layers.2.self_attn.q_proj.weight\n" in msg and "layers.2.self_attn.k_proj" not in msg


def test_reader_and_config_inputs():
    reader = StateDictReader({"a": torch.zeros(2, 3, dtype=torch.bfloat16),
                              "b": torch.zeros(4, dtype=torch.float8_e4m3fn)})
    assert reader.meta("a") == ((2, 3), "BF16") and reader.meta("b") == ((4,), "F8_E4M3")
    assert reader.names() == {"a", "b"} and reader.files == {"a": None, "b": None}
    with pytest.raises(CheckpointError, match="not tensors: x"):
        StateDictReader({"x": [1.0]})
    with pytest.raises(TypeError, match="got int"):
        model_config_from(3)
    nested = model_config_from({"text_config": text_config()})
    assert nested.architecture == "Glm5NextForConditionalGeneration" and nested.has_lm_head
    assert model_config_from(nested) is nested
