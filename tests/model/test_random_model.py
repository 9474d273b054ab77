"""``random_model``: a model of any config with random weights, made tensor by tensor."""

import torch

from flashinfra.model.api import model_config_from, random_model
from flashinfra.model.factory import TINY_TEXT_CONFIG, RandomSource


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = (random_model(TINY_TEXT_CONFIG, "float32", "cpu", seed=s) for s in (1, 1, 2))
    la, lb, lc = (m.logits([[5, 6, 7, 8]])[0] for m in (a, b, c))
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)
    assert torch.isfinite(la).all() and 0.1 < float(la.std()) < 10


def test_source_makes_each_tensor_only_when_asked():
    cfg = model_config_from(TINY_TEXT_CONFIG)
    src = RandomSource(cfg, torch.bfloat16, "cpu", seed=0)
    name = next(n for n in sorted(src.names()) if n.endswith("q_a_proj.weight"))
    shape, dtype = src.meta(name)
    t = src.get(name)
    assert tuple(t.shape) == shape and t.dtype == torch.bfloat16 and dtype == "BF16"
    assert torch.equal(t, src.get(name))  # seeded by name: the same tensor whenever asked
    norms = [src.get(n) for n in src.names() if n.endswith("input_layernorm.weight")]
    assert all(abs(float(n.float().mean()) - 1) < 0.1 for n in norms)
