"""``flashinfra eval perplexity``: window counting, packing, agreement with an unpacked computation and with
transformers, and the command line.

``data/heldout-slice.txt`` is a slice of the default model's held-out text (the start of the first
held-out Bible chapter, two fortunes and the start of a Python manual node), which it never trained on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import flashinfra
from flashinfra.cli import main
from flashinfra.eval.perplexity import make_windows, pack_windows, perplexity
from flashinfra.model.factory import default_model_dir, write_tiny_checkpoint

SLICE = Path(__file__).parent / "data" / "heldout-slice.txt"


@pytest.mark.parametrize(
    "num_tokens,window,stride",
    [(2, 2, None), (3, 2, None), (1000, 64, None), (1000, 64, 63), (1000, 64, 17), (63, 64, None), (64, 64, 1),
     (65, 64, None), (129, 8, 3)],
)
def test_every_token_after_the_first_is_scored_exactly_once(num_tokens, window, stride):
    windows = make_windows(num_tokens, window, stride)
    scored = [t for w in windows for t in range(w.first_scored, w.end)]
    assert sorted(scored) == list(range(1, num_tokens))
    for w in windows:
        assert 0 <= w.start < w.first_scored <= w.end <= num_tokens  # each scored token has context
        assert w.length <= window
        assert w.num_scored >= 1


@pytest.mark.parametrize("num_tokens,window,stride", [(1, 8, None), (10, 1, None), (10, 8, 8), (10, 8, 0)])
def test_bad_window_arguments_are_refused(num_tokens, window, stride):
    with pytest.raises(ValueError):
        make_windows(num_tokens, window, stride)


def test_packing_keeps_order_and_respects_the_token_budget():
    windows = make_windows(1000, 64, 50)
    batches = pack_windows(windows, 200)
    assert [w for b in batches for w in b] == windows
    assert all(sum(w.length for w in b) <= 200 for b in batches)
    assert len(batches) > 1
    with pytest.raises(ValueError, match="smaller than one window"):
        pack_windows(windows, 63)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)
    return path, flashinfra.load_model(path, dtype="float32")


def _unpacked_nll(model, ids: list[int], windows) -> tuple[float, int]:
    """Each window run alone through ``LoadedModel.logits``, its scored tokens summed: an independent path."""
    total, count = 0.0, 0
    for w in windows:
        logits = model.logits([ids[w.start : w.end]])[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for t in range(w.first_scored, w.end):
            total -= float(logp[t - 1 - w.start, ids[t]])
            count += 1
    return total, count


def test_packed_perplexity_equals_window_by_window(tiny):
    """Overlapping windows (stride 13 < window 20 - 1), two packed batches, logits taken in row chunks."""
    _, model = tiny
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.text.vocab_size, (53,), generator=g).tolist()
    windows = make_windows(len(ids), 20, 13)
    assert len(pack_windows(windows, 45)) == 2
    result = perplexity(model, ids, 20, 13, max_batch_tokens=45, logits_rows=11)
    nll, count = _unpacked_nll(model, ids, windows)
    assert result.tokens_scored == count == len(ids) - 1
    assert result.nll_sum == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_out_of_vocabulary_ids_are_refused(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="token ids"):
        perplexity(model, [1, 2, model.config.text.vocab_size], window=8)


def test_cli_prints_json_with_honest_counts(tiny, tmp_path, capsys):
    path, _ = tiny
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 6, encoding="utf-8")
    assert main(["eval", "perplexity", "--model", str(path), "--window", "16", "--device", "cpu", str(text)]) == 0
    out = json.loads(capsys.readouterr().out)
    from tokenizers import Tokenizer

    n = len(Tokenizer.from_file(str(path / "tokenizer.json")).encode(text.read_text()).ids)
    assert out["tokens_scored"] == n - 1
    assert out["windows"] == len(make_windows(n, 16))
    assert out["perplexity"] == pytest.approx(math.exp(out["nll_sum"] / out["tokens_scored"]))


def test_cli_errors_are_clear(tiny, tmp_path):
    path, _ = tiny
    with pytest.raises(SystemExit, match="no such file"):
        main(["eval", "perplexity", "--model", str(path), str(tmp_path / "absent.txt")])
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\xfa text")
    with pytest.raises(SystemExit, match="not UTF-8"):
        main(["eval", "perplexity", "--model", str(path), str(binary)])
    short = tmp_path / "s.txt"
    short.write_text("a", encoding="utf-8")
    with pytest.raises(SystemExit, match="at least 2"):
        main(["eval", "perplexity", "--model", str(path), str(short)])
    text = tmp_path / "t.txt"
    text.write_text("hello there, general", encoding="utf-8")
    with pytest.raises(SystemExit, match="stride"):
        main(["eval", "perplexity", "--model", str(path), "--window", "4", "--stride", "4", str(text)])


def _transformers_perplexity(model_dir: Path, ids: list[int], window: int) -> tuple[float, int]:
    """The same windows and counting, computed by transformers' own model (float32, one window per call)."""
    from transformers import Glm5NextForConditionalGeneration

    hf = Glm5NextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in make_windows(len(ids), window):
            logits = hf(input_ids=torch.tensor([ids[w.start : w.end]])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            rows = torch.arange(w.first_scored - 1 - w.start, w.length - 1)
            targets = torch.tensor(ids[w.first_scored : w.end])
            total -= float(logp[rows, targets].sum())
            count += len(targets)
    return math.exp(total / count), count


def test_default_model_perplexity_matches_transformers_on_heldout_text():
    """The acceptance check: float32 perplexity through flashinfra and through transformers agree within 0.1%.

    Windows of 256 tokens exceed the indexer's top-k (128 tokens in pools of 4), so the sparse selection
    is part of what is compared.
    """
    from tokenizers import Tokenizer

    model_dir = default_model_dir()
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(SLICE.read_text(encoding="utf-8")).ids
    model = flashinfra.load_model(model_dir, dtype="float32")
    assert model.config.text.index_topk < 256
    ours = perplexity(model, ids, window=256, max_batch_tokens=1024)
    theirs, count = _transformers_perplexity(model_dir, ids, 256)
    assert ours.tokens_scored == count == len(ids) - 1
    assert ours.windows > 1
    assert abs(ours.perplexity / theirs - 1) < 1e-3, (ours.perplexity, theirs)
