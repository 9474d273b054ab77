"""``train/train_mtp.py`` on a tiny random target (CPU): the layer it writes loads strictly into the engine's MTP
block and reads back, the target's tensors stay as they were, the unrolled training block computes what the
engine's draft chain does (catch-up and chained steps, DSA selection included), and a chained training run of a
few steps writes a loadable layer."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TRAIN = Path(__file__).resolve().parent.parent / "train"
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "flashinfra" / "assets" / "default-model"
SPECIAL = ["<|endoftext|>", "<|user|>", "<|observation|>", "<|assistant|>", "[gMASK]", "<sop>", "<|image|>",
           "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>"]


def _train_module(name: str):
    sys.path.insert(0, str(TRAIN))  # the training scripts import their siblings (train_model, kda_chunk) by name
    try:
        spec = importlib.util.spec_from_file_location(name, TRAIN / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(TRAIN))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target whose indexer keeps 2 pools of 4 (so the DSA selection matters at 20 tokens), a perturbed MTP
    block (norm weights too: with unit ``shared_head.norm`` weights, feeding the chain its normed hidden would pass
    for the raw one) whose weights are what bf16 storage keeps, and the checkpoint with that layer written in."""
    from transformers import Glm5NextForConditionalGeneration

    tm, train_model = _train_module("train_mtp"), _train_module("train_model")
    cfg = train_model.model_config({t: i for i, t in enumerate(SPECIAL, 500)}, tiny=True)
    cfg.text_config.index_topk = 8
    torch.manual_seed(0)
    target = Glm5NextForConditionalGeneration(cfg).eval().requires_grad_(False)
    root = tmp_path_factory.mktemp("train-mtp")
    src = root / "target"
    target.to(torch.bfloat16).save_pretrained(src)
    target = Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval().requires_grad_(False)
    block = tm.MTPTrainBlock(target)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(p + 0.05 * torch.randn_like(p) if p.ndim >= 2 else p * (1 + 0.2 * torch.randn_like(p)))
            p.copy_(p.to(torch.bfloat16).float())
        block.mlp.gate.e_score_correction_bias.copy_(block.mlp.gate.e_score_correction_bias.bfloat16().float())
    out = root / "with-mtp"
    prefix = f"model.language_model.layers.{target.config.text_config.num_hidden_layers}."
    tm.write_checkpoint(src, out, tm.mtp_tensors(target, block), prefix)
    return tm, target, block, src, out, prefix


def test_every_weight_of_the_block_trains_beside_a_frozen_target(tiny):
    """The block copies its attention and MoE from the frozen target: the copies must train too."""
    tm, target, block, *_ = tiny
    assert not any(p.requires_grad for p in target.parameters())
    frozen = [n for n, p in tm.MTPTrainBlock(target).named_parameters() if not p.requires_grad]
    assert not frozen, f"frozen block weights: {frozen[:5]}"


def test_written_layer_loads_reads_back_and_matches_the_training_module(tiny, tmp_path):
    from flashinfra.model.api import load_model
    from flashinfra.model.forward_batch import ForwardBatch
    from flashinfra.model.loader import CheckpointReader
    from flashinfra.model.mtp import MTPBlock, allocate_mtp_cache, load_mtp

    from flashinfra.kernels.dsa_pool_keys import compress_pools
    from flashinfra.model.indexer import top_pools

    tm, target, block, src, out, prefix = tiny
    mb = sys.modules[tm.MTPTrainBlock.__module__]  # restates the engine's pool compression and top-k: the same
    scores = torch.randint(0, 3, (5, 7, 13)).float()  # ties everywhere
    assert torch.equal(mb.top_pools(scores, 4), top_pools(scores, 4))
    entries, ape = torch.randn(9, 4, 32), torch.randn(4, 16)
    assert torch.equal(mb.compress_pools(entries, ape), compress_pools(entries, ape))

    before, after = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)

    model = load_model(out, dtype="float32")
    text = model.config.text
    engine = MTPBlock(text, torch.float32)
    assert load_mtp(engine, model.config, CheckpointReader(out)) == len(set(after) - set(before))

    L = 23  # past index_topk + the tail: the selection drops pools
    x = torch.randint(0, text.vocab_size, (1, L + 1))
    hidden = torch.randn(1, L, text.hidden_size)
    embed = target.model.language_model.embed_tokens
    with torch.no_grad():
        want = block.chain(embed, x, hidden, 1)[0][0]
    cache = allocate_mtp_cache(text, num_blocks=8, block_size=4, num_slots=2, dtype=torch.float32, device="cpu")
    batch = ForwardBatch.build([L], [0], [0], [list(range(6))], 4, "cpu")
    got = engine(embed(x[0, 1:]), hidden[0], batch, cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # the written layer reads back into a fresh block as it was
    fresh = tm.MTPTrainBlock(target)
    assert tm.read_mtp_layer(out, target, fresh)
    assert not tm.read_mtp_layer(src, target, tm.MTPTrainBlock(target))
    got_state, want_state = fresh.state_dict(), block.state_dict()
    assert set(got_state) == set(want_state)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)

    # retraining a checkpoint that has the layer replaces it, the target's tensors as they were
    with torch.no_grad():
        block_flipped = tm.MTPTrainBlock(target)
        block_flipped.load_state_dict(block.state_dict())
        block_flipped.eh_proj.weight.mul_(-1)
    again = tmp_path / "retrained"
    tm.write_checkpoint(out, again, tm.mtp_tensors(target, block_flipped), prefix)
    retrained = load_file(str(again / "model.safetensors"))
    assert set(retrained) == set(after)
    assert all(torch.equal(before[k], retrained[k]) for k in before)
    assert torch.equal(retrained[prefix + "eh_proj.weight"], -after[prefix + "eh_proj.weight"])


def test_chained_steps_equal_the_engine_draft_chain(tiny, monkeypatch):
    """Greedy decoding with k = 3 drafts: at every draft round the engine's MTP outputs (the catch-up rows, then
    each chained step) equal the training block's steps at the same base, on the window of the committed tokens
    followed by the drafts fed to the chain."""
    import flashinfra
    from flashinfra import SamplingParams

    tm, target, block, _, out, _ = tiny
    llm = flashinfra.LLM(out, num_blocks=64, block_size=4, max_num_seqs=2, speculative_tokens=3)
    spec = llm.engine.runner.speculator
    calls: list[torch.Tensor] = []
    spec.mtp.register_forward_hook(lambda _m, _a, o: calls.append(o.clone()))
    rounds = []
    real = spec.draft

    def recording(sched, feeds, cu, hidden, committed, nexts):
        calls.clear()
        real(sched, feeds, cu, hidden, committed, nexts)
        for b, sr in enumerate(sched):
            if nexts[b] is not None and sr.request_id in spec.drafts:
                seq = (list(sr.prompt_token_ids) + list(sr.output_token_ids)
                       + feeds[b][sr.num_new_tokens : committed[b]] + [nexts[b]])
                rounds.append((seq, list(spec.drafts[sr.request_id]), list(calls)))

    monkeypatch.setattr(spec, "draft", recording)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for n in (17, 22):
        llm.generate([torch.randint(10, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()], params)

    embed = target.model.language_model.embed_tokens
    chained = 0
    for seq, drafts, outs in rounds:
        x = torch.tensor([seq + drafts[:-1]])
        base = len(seq) - 2  # the last catch-up entry: target hidden at base, the token just emitted
        with torch.no_grad():
            h = target.model(input_ids=x).last_hidden_state
            steps = block.chain(embed, x, h, len(drafts))
        catch_up = outs[0]
        torch.testing.assert_close(steps[0][0, base + 1 - catch_up.shape[0] : base + 1], catch_up,
                                   rtol=1e-4, atol=1e-4)
        assert len(outs) == len(drafts)
        for s in range(1, len(drafts)):
            torch.testing.assert_close(steps[s][0, base], outs[s][0], rtol=1e-4, atol=1e-4)
            logits = target.lm_head(block.head_norm(steps[s][0, base]))
            assert int(logits.argmax()) == drafts[s]
            chained += 1
    assert chained >= 10


def test_chained_training_writes_a_loadable_layer(tmp_path, monkeypatch):
    """Two steps of ``--chain 2`` on a tiny target (CPU); the summary reports each chained position and the
    written layer loads strictly into the engine's block."""
    from tokenizers import Tokenizer
    from transformers import Glm5NextForConditionalGeneration
    from transformers.models.glm5_next import modeling_glm5_next

    from flashinfra.model.api import load_model
    from flashinfra.model.loader import CheckpointReader
    from flashinfra.model.mtp import MTPBlock, load_mtp

    tm, train_model = _train_module("train_mtp"), _train_module("train_model")
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    torch.manual_seed(1)
    model_dir = tmp_path / "target"
    target = Glm5NextForConditionalGeneration(train_model.model_config(train_model.special_ids(tok), tiny=True))
    target.to(torch.bfloat16).save_pretrained(model_dir)
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", model_dir / "tokenizer.json")
    text = (Path(__file__).parent / "eval" / "data" / "heldout-slice.txt").read_text()
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 4), ("heldout", 2)):
        rows = [json.dumps({"source": "test", "text": text[i * 7 :] + text[: i * 7]}) for i in range(n)]
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")

    monkeypatch.setattr(modeling_glm5_next, "chunk_kimi_delta_attention", modeling_glm5_next.chunk_kimi_delta_attention)
    monkeypatch.syspath_prepend(str(TRAIN))
    threads = torch.get_num_threads()
    out = tmp_path / "mtp"
    try:
        summary = tm.train(tm.parse_args(["--model", str(model_dir), "--data", str(data), "--out", str(out),
                                          "--device", "cpu", "--max-steps", "2", "--batch", "2", "--chain", "2",
                                          "--eval-batches", "1", "--log-every", "1", "--threads", str(threads)]))
    finally:
        torch.set_num_threads(threads)
    assert summary["steps"] == 2 and summary["started_from"] == "the target's last attention layer"
    for when in ("before", "after"):
        assert len(summary[when]["heldout_chain_agreement"]) == 2
        assert summary[when]["heldout_chain_agreement"][0] == summary[when]["heldout_first_draft_agreement"]
    rows = [json.loads(line) for line in out.with_suffix(".log.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)

    model = load_model(out, dtype="float32")
    engine = MTPBlock(model.config.text, torch.float32)
    assert load_mtp(engine, model.config, CheckpointReader(out)) > 0
    assert json.loads((out / "mtp-train-summary.json").read_text())["steps"] == 2
