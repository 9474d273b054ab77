"""MTP block: release-name loading (strict), the draft input against a float64 reference, its own caches."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashinfra
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.model.loader import CheckpointError, CheckpointReader
from flashinfra.model.mtp import MTPBlock, allocate_mtp_cache, has_mtp, load_mtp


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), seed=5, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def loaded(ckpt):
    lm = flashinfra.load_model(ckpt)
    block = MTPBlock(lm.config.text, torch.float32)
    n = load_mtp(block, lm.config, CheckpointReader(ckpt))
    return lm, block.eval(), n


def test_release_names_load_strictly(ckpt, loaded, tmp_path):
    lm, block, n = loaded
    N = lm.config.text.num_hidden_layers
    names = CheckpointReader(ckpt).names()
    assert has_mtp(lm.config, names) and n > 0
    assert all(k.startswith(f"model.language_model.layers.{N}.") for k in lm.report.extra)  # kept, not run
    for p in block.parameters():
        assert torch.isfinite(p).all()
    t = load_file(str(ckpt / "model.safetensors"))
    del t[f"model.language_model.layers.{N}.eh_proj.weight"]
    t[f"model.language_model.layers.{N}.bogus.weight"] = torch.zeros(2)
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="eh_proj.weight(.|\n)*bogus.weight"):
        load_mtp(MTPBlock(lm.config.text, torch.float32), lm.config, CheckpointReader(tmp_path))


def _rms64(x, w, eps):
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_draft_input_is_stream_mean_after_final_norm(loaded):
    """SGLang #36829: the draft input must use the mean of the mHC streams after the final norm."""
    lm, block, _ = loaded
    cfg, model = lm.config.text, lm.model
    g = torch.Generator().manual_seed(0)
    T, n, D = 7, cfg.hc_mult, cfg.hidden_size
    streams = torch.randn(T, n, D, generator=g) * torch.linspace(0.5, 2.0, n)[None, :, None]
    nxt = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    ours = block.assemble(model.embed_tokens[nxt], model.final_norm(streams))

    eps = cfg.rms_norm_eps
    hidden = _rms64(streams.double().mean(1), model.norm, eps)
    e = _rms64(model.embed_tokens[nxt].double(), block.enorm, eps)
    ref = torch.cat([e, _rms64(hidden, block.hnorm, eps)], -1) @ block.eh_proj.double().T
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)
    wrong = block.assemble(model.embed_tokens[nxt], model.final_norm(streams[:, :1].expand(-1, n, -1)))
    assert (wrong.double() - ref).abs().max() > 1e-2


def test_mtp_caches_prefill_then_decode(loaded):
    """The block's own latent/indexer caches: prefilling T-1 positions then one more equals one prefill."""
    lm, block, _ = loaded
    cfg = lm.config.text
    g = torch.Generator().manual_seed(1)
    T, D, bs = 11, cfg.hidden_size, 4
    emb, hid = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    table = [list(range(3))]
    cache = allocate_mtp_cache(cfg, 3, bs, 1, torch.float32, "cpu")
    full = block(emb, hid, ForwardBatch.build([T], [0], [0], table, bs, "cpu"), cache)
    cache = allocate_mtp_cache(cfg, 3, bs, 1, torch.float32, "cpu")
    block(emb[:-1], hid[:-1], ForwardBatch.build([T - 1], [0], [0], table, bs, "cpu"), cache)
    last = block(emb[-1:], hid[-1:], ForwardBatch.build([1], [T - 1], [0], table, bs, "cpu"), cache)
    torch.testing.assert_close(last, full[-1:], rtol=1e-4, atol=1e-4)
    logits = lm.compute_logits(block.logits_hidden(full))
    assert logits.shape == (T, cfg.vocab_size) and torch.isfinite(logits).all()
