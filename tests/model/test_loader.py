"""Checkpoint loader: release and packed layouts, block-FP8, shards, and loud failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashinfra
from flashinfra.model.factory import write_tiny_checkpoint
from flashinfra.model.loader import CheckpointError, dequantize_block_fp8

IDS = [[5, 17, 3, 99, 250, 7, 1, 42, 8, 11, 300, 12, 13]]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("base"), seed=3)


@pytest.fixture(scope="module")
def base_logits(base) -> torch.Tensor:
    return flashinfra.load_model(base).logits(IDS)[0]


def clone_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config_edit=None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_packed_experts_and_in_memory_names(base, base_logits, tmp_path):
    t = load_file(str(base / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    per_layer: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, x in t.items():
        if ".mlp.experts." in name:
            pre, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            per_layer.setdefault(pre, {}).setdefault(int(e), {})[proj] = x
        elif "_conv1d." in name:
            continue
        elif ".hc_attn_" in name or ".hc_ffn_" in name:
            pre, part = name.rsplit(".hc_", 1)
            kind, field = part.split("_", 1)
            packed[f"{pre}.{kind}_hc.{field}"] = x
        else:
            packed[name] = x
    for name in t:
        if name.endswith("q_conv1d.weight"):
            pre = name[: -len("q_conv1d.weight")]
            packed[pre + "conv1d.weight"] = torch.cat([t[pre + f"{c}_conv1d.weight"] for c in "qkv"])
    for pre, experts in per_layer.items():
        E = len(experts)
        packed[f"{pre}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(E)])
        packed[f"{pre}.mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(E)])
    path = clone_with(base, tmp_path / "packed", packed)
    assert torch.equal(flashinfra.load_model(path).logits(IDS)[0], base_logits)


def quantize_block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = w.shape
    nr, nc = -(-R // block), -(-C // block)
    scale = torch.empty(nr, nc)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
    s = scale.repeat_interleave(block, 0)[:R].repeat_interleave(block, 1)[:, :C]
    return (w / s).to(torch.float8_e4m3fn), scale


def test_block_fp8_experts_dequantized_at_load(base, tmp_path):
    t = load_file(str(base / "model.safetensors"))
    fp8, dequant = {}, {}
    for name, x in t.items():
        if ".mlp.experts." in name:
            q, s = quantize_block_fp8(x, block=16)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = q, s
            dequant[name] = dequantize_block_fp8(q, s, (16, 16))
        else:
            fp8[name] = dequant[name] = x

    def add_quant(cfg):
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 16]}

    m8 = flashinfra.load_model(clone_with(base, tmp_path / "fp8", fp8, add_quant))
    m32 = flashinfra.load_model(clone_with(base, tmp_path / "deq", dequant))
    assert torch.equal(m8.logits(IDS)[0], m32.logits(IDS)[0])
    # the quantization really happened: dequantized weights differ from the originals, within FP8 precision
    name = next(n for n in t if ".mlp.experts." in n)
    err = (dequant[name] - t[name]).abs().max() / t[name].abs().max()
    assert 0 < err < 0.07


def test_sharded_checkpoint(base, base_logits, tmp_path):
    t = load_file(str(base / "model.safetensors"))
    names = sorted(t)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    out = tmp_path / "sharded"
    out.mkdir()
    for fname, members in shards.items():
        save_file({n: t[n] for n in members}, str(out / fname))
    weight_map = {n: f for f, members in shards.items() for n in members}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((base / "config.json").read_text())
    assert torch.equal(flashinfra.load_model(out).logits(IDS)[0], base_logits)


@pytest.mark.parametrize("victim", ["layers.1.mlp.experts.3.up_proj.weight", "layers.0.self_attn.k_conv1d.weight",
                                    "layers.4.hc_ffn_fn", "layers.3.self_attn.indexer.wk.weight", "lm_head.weight"])
def test_missing_tensor_is_named(base, tmp_path, victim):
    t = load_file(str(base / "model.safetensors"))
    full = victim if victim == "lm_head.weight" else "model.language_model." + victim
    del t[full]
    with pytest.raises(CheckpointError, match=f"missing: {full.replace('.', '[.]')}"):
        flashinfra.load_model(clone_with(base, tmp_path / "missing", t))


def test_misshaped_and_unexpected_tensors_are_named(base, tmp_path):
    t = load_file(str(base / "model.safetensors"))
    bad = "model.language_model.layers.2.mlp.experts.0.down_proj.weight"
    t[bad] = t[bad][:, :-1].contiguous()
    t["model.language_model.layers.2.mlp.experts.99.down_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(CheckpointError) as info:
        flashinfra.load_model(clone_with(base, tmp_path / "bad", t))
    msg = str(info.value)
    assert f"mis-shaped: {bad}" in msg
    assert "unexpected: model.language_model.layers.2.mlp.experts.99.down_proj.weight" in msg


def test_mtp_and_vision_tensors_are_recognised_and_kept(base, base_logits, tmp_path):
    t = load_file(str(base / "model.safetensors"))
    n = json.loads((base / "config.json").read_text())["text_config"]["num_hidden_layers"]
    extra = {f"model.language_model.layers.{n}.eh_proj.weight": torch.randn(4, 4),
             "model.visual.patch_embed.proj.weight": torch.randn(2, 3)}
    m = flashinfra.load_model(clone_with(base, tmp_path / "mtp", {**t, **extra}))
    assert set(m.report.extra) == set(extra)
    assert torch.equal(m.logits(IDS)[0], base_logits)


def test_progress_bar_on_stderr_only_when_asked_or_a_terminal(base, capsys):
    from flashinfra.config import load_config
    from flashinfra.model.glm5_next import Glm5NextModel
    from flashinfra.model.loader import CheckpointReader, load_weights

    cfg = load_config(base)
    for progress in (None, True):
        model = Glm5NextModel(cfg.text, torch.float32, cfg.has_lm_head)
        report = load_weights(model, cfg, CheckpointReader(base), progress=progress)
        err = capsys.readouterr().err
        if progress:
            assert "loading 1 file" in err and f"/{report.loaded} " in err and "tensor" in err, err
        else:
            assert err == ""  # pytest's stderr is no terminal
