"""``train/train_mtp.py`` on a tiny random target (CPU): the layer it writes loads strictly into the engine's MTP
block, the target's tensors stay as they were, and the training module computes what the engine's block does."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TRAIN = Path(__file__).resolve().parent.parent / "train"


def _train_mtp():
    sys.path.insert(0, str(TRAIN))  # train_mtp imports its siblings (train_model, kda_chunk) by name
    try:
        spec = importlib.util.spec_from_file_location("train_mtp", TRAIN / "train_mtp.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(TRAIN))


def test_written_layer_loads_and_matches_the_training_module(tmp_path):
    from transformers import Glm5NextForConditionalGeneration

    from flashinfra.model.api import load_model
    from flashinfra.model.forward_batch import ForwardBatch
    from flashinfra.model.loader import CheckpointReader
    from flashinfra.model.mtp import MTPBlock, allocate_mtp_cache, load_mtp

    tm = _train_mtp()
    sys.path.insert(0, str(TRAIN))
    try:
        from train_model import model_config
    finally:
        sys.path.remove(str(TRAIN))
    special = {t: i for i, t in enumerate(["<|endoftext|>", "<|user|>", "<|observation|>", "<|assistant|>", "[gMASK]",
                                           "<sop>", "<|image|>", "<|video|>", "<|begin_of_image|>",
                                           "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"], 500)}
    torch.manual_seed(0)
    target = Glm5NextForConditionalGeneration(model_config(special, tiny=True)).eval().requires_grad_(False)
    src = tmp_path / "target"
    target.to(torch.bfloat16).save_pretrained(src)
    target = Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval().requires_grad_(False)
    block = tm.MTPTrainBlock(target)
    with torch.no_grad():
        for p in block.parameters():  # what bf16 storage keeps, so both sides read the same weights
            p.copy_(p + 0.05 * torch.randn_like(p) if p.ndim >= 2 else p)
            p.copy_(p.to(torch.bfloat16).float())
        block.mlp.gate.e_score_correction_bias.copy_(block.mlp.gate.e_score_correction_bias.bfloat16().float())
    out = tmp_path / "with-mtp"
    prefix = f"model.language_model.layers.{target.config.text_config.num_hidden_layers}."
    tm.write_checkpoint(src, out, tm.mtp_tensors(target, block), prefix)

    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)

    model = load_model(out, dtype="float32")
    text = model.config.text
    engine = MTPBlock(text, torch.float32)
    assert load_mtp(engine, model.config, CheckpointReader(out)) == len(set(after) - set(before))

    L, D = 11, text.hidden_size
    embeds, hidden = torch.randn(1, L, D), torch.randn(1, L, D)
    with torch.no_grad():
        want = block(embeds, hidden)[0]
    cache = allocate_mtp_cache(text, num_blocks=8, block_size=4, num_slots=2, dtype=torch.float32, device="cpu")
    batch = ForwardBatch.build([L], [0], [0], [[0, 1, 2]], 4, "cpu")
    got = engine(embeds[0], hidden[0], batch, cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # retraining a checkpoint that has the layer replaces it, the target's tensors as they were
    with torch.no_grad():
        block.eh_proj.weight.mul_(-1)
    again = tmp_path / "retrained"
    tm.write_checkpoint(out, again, tm.mtp_tensors(target, block), prefix)
    retrained = load_file(str(again / "model.safetensors"))
    assert set(retrained) == set(after)
    assert all(torch.equal(before[k], retrained[k]) for k in before)
    assert torch.equal(retrained[prefix + "eh_proj.weight"], -after[prefix + "eh_proj.weight"])
