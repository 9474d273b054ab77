"""``flashinfra plan`` on the full GLM-5.3-Flash preset: 4 and 8 H200s in bf16, FP8 and INT8."""

from __future__ import annotations

import json

import pytest

from flashinfra.cli import main
from flashinfra.parallel.plan import GLM_5_3_FLASH, plan

GIB = 2**30


@pytest.mark.parametrize("gpus,dtype,fits", [(4, "bf16", False), (4, "fp8", True), (4, "int8", True),
                                             (8, "bf16", True), (8, "fp8", True), (8, "int8", True)])
def test_full_model_on_h200s(gpus, dtype, fits):
    r = plan(GLM_5_3_FLASH, gpus, weight_dtype=dtype)
    assert r.fits is fits, r.reason
    # about 313B trunk parameters (321B with the MTP block and vision tower, not counted here)
    params = 300e9 < r.weight_bytes_total / (2 if dtype == "bf16" else 1) < 330e9
    assert params, r.weight_bytes_total
    # the sharded part is 1/N of the model's sharded part; the replicated part is under 1 GiB
    assert r.replicated_bytes_per_rank < GIB
    assert r.sharded_bytes_per_rank == pytest.approx((r.weight_bytes_total - r.replicated_bytes_per_rank) / gpus,
                                                     rel=1e-3)
    assert (r.cache_tokens > 10**6) is fits


def test_plan_cli_json_and_refusal(capsys):
    assert main(["plan", "--preset", "glm-5.3-flash", "--gpus", "8", "--dtype", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["tp"] == 8 and out["ep"] == 8
    assert main(["plan", "--preset", "glm-5.3-flash", "--gpus", "4"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is not divisible by 5"):
        main(["plan", "--preset", "glm-5.3-flash", "--gpus", "5"])


def test_expert_parallel_over_more_ranks_than_tensor_parallel():
    wide = plan(GLM_5_3_FLASH, 8, tp=2, ep=8, weight_dtype="fp8")
    full = plan(GLM_5_3_FLASH, 8, tp=8, ep=8, weight_dtype="fp8")
    assert wide.fits and (wide.tp, wide.ep) == (2, 8)
    # attention, dense MLPs and the vocabulary split 2 ways instead of 8: more bytes per rank, same experts
    assert full.weight_bytes_per_rank < wide.weight_bytes_per_rank < 1.5 * full.weight_bytes_per_rank
    with pytest.raises(ValueError, match=r"run on max\(tp, ep\) = 8 GPUs, not --gpus 4"):
        plan(GLM_5_3_FLASH, 4, tp=2, ep=8)


def test_8bit_caches_and_fp8_splits_of_the_full_model(tmp_path):
    from flashinfra.config import load_config
    from flashinfra.parallel.plan import write_model_dir

    base = plan(GLM_5_3_FLASH, 8, weight_dtype="fp8")
    small = plan(GLM_5_3_FLASH, 8, weight_dtype="fp8", kv_cache_dtype="fp8", kda_state_dtype="bfloat16")
    assert small.weight_bytes_per_rank == base.weight_bytes_per_rank
    assert small.cache_bytes_per_token < 0.55 * base.cache_bytes_per_token  # e4m3 latent and indexer keys + scales
    assert small.kda_state_bytes_per_seq < 0.55 * base.kda_state_bytes_per_seq
    assert small.cache_tokens > 1.9 * base.cache_tokens
    # every FP8 slice whole 128 x 128 blocks at TP 8 (so at 2 and 4, unions of them), experts split or whole
    assert plan(GLM_5_3_FLASH, 8, tp=8, ep=1, weight_dtype="fp8").fits
    path = write_model_dir(GLM_5_3_FLASH, tmp_path / "glm")
    text = load_config(path).text
    assert text.num_hidden_layers == 45 and text.eos_token_id and (path / "tokenizer.json").is_file()
