"""config.json in both forms, derived values, and the kpool the checkpoint states."""

from __future__ import annotations

import pytest

from flashinfra.config import resolve_config
from flashinfra.model.factory import TINY_TEXT_CONFIG


def test_flat_and_nested_forms_agree():
    nested = resolve_config({"architectures": ["Glm5NextForConditionalGeneration"], "text_config": TINY_TEXT_CONFIG})
    flat = resolve_config({"architectures": ["Glm5NextTextModel"], **TINY_TEXT_CONFIG})
    assert nested.text == flat.text
    assert nested.has_lm_head and not flat.has_lm_head
    assert flat.weight_prefix == "" and nested.weight_prefix == "model.language_model."


def test_release_defaults_and_kpool_from_config():
    cfg = resolve_config({"text_config": {"index_kpool": 4}}).text
    assert cfg.index_kpool == 4 and cfg.num_hidden_layers == 45
    assert cfg.mla_layers == tuple(range(3, 45, 4)) and len(cfg.kda_layers) == 34
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert resolve_config({"text_config": {}}).text.index_kpool == 16


def test_shared_indexer_resolves_to_previous_full_layer():
    cfg = resolve_config({"text_config": TINY_TEXT_CONFIG}).text
    assert cfg.indexer_layers == (3,) and cfg.indexer_source(4) == 3


@pytest.mark.parametrize("bad", [{"index_topk": 10, "index_kpool": 4}, {"qk_rope_head_dim": 64},
                                 {"n_routed_experts": 10, "n_group": 4}])
def test_invalid_configs_are_rejected(bad):
    with pytest.raises(ValueError):
        resolve_config({"text_config": {**TINY_TEXT_CONFIG, **bad}})


def test_shared_indexer_without_full_layer_is_rejected():
    bad = {**TINY_TEXT_CONFIG, "indexer_types": ["full", "full", "full", "shared", "shared", "full"]}
    with pytest.raises(ValueError, match="no full indexer"):
        resolve_config({"text_config": bad})
