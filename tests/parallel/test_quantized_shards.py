"""8-bit weights and caches over CPU gloo (two spawned ranks, one spawn for every case):

- every rank's 8-bit weights are its slice of the one-rank quantization, code for code and scale for scale, from
  a pre-quantized checkpoint (``flashinfra quantize``) and from ``--quantization`` of a float checkpoint;
- FP8 (blocks of 128 whole on every rank: per-128-channel activation scales are those of one rank) and the
  random FP8 model made shard by shard: logits equal one rank's within float32 rounding, with fp8 / int8
  latent caches and bf16 KDA states too;
- W8A8 quantizes activations per token over the columns a rank holds, so a row-parallel projection's
  activation scale is its slice's, not the whole row's: logits of the trained default model stay within
  a rounding budget of one rank's (a random tiny model is too chaotic for one);
- an FP8 split that cuts a block is refused before anything starts, naming the tensor.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from flashinfra.config import load_config
from flashinfra.engine.config import EngineConfig
from flashinfra.model.api import load_model, random_model
from flashinfra.model.factory import default_model_dir, write_tiny_checkpoint
from flashinfra.parallel.collectives import ParallelComms
from flashinfra.parallel.engine import check_layout
from flashinfra.parallel.layout import LayoutError, make_layout
from flashinfra.quant.cache import CacheSpec
from flashinfra.quant.checkpoint import quantize_checkpoint

PROMPTS = [[5, 17, 3, 99, 200, 7, 8, 9, 10, 11, 300, 1, 2, 250, 251, 252, 40], [40, 41, 42, 43, 44, 45, 46]]
# every slice of a rank whole 128-row / 128-column blocks at TP 2: 2 heads x 64 per rank, 128 of 256 channels
ALIGNED = dict(linear_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, intermediate_size=256,
               moe_intermediate_size=256)
# float64 activations: the partial sums' order moves a hidden state by about 1e-16, which no float32 cast before an
# 8-bit rounding (activations, latent cache, bf16 state) sees; in float32 such a move flips a rounding now and then,
# and a random tiny model (its routing above all) magnifies one flip far past float32 rounding
DTYPE = torch.float64
LAYOUTS = [(2, 1), (2, 2)]  # (tp, ep): experts split by width, or whole experts per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(model) -> dict[str, torch.Tensor]:
    """Every weight of a model as plain tensors: parameters, and the codes and scales of 8-bit weights."""
    from flashinfra.quant.model import quantized_weights

    out = {n: p.detach() for n, p in model.named_parameters()}
    for n, w in quantized_weights(model).items():
        out[n + ".codes"], out[n + ".scale"] = w.data.view(torch.uint8), w.scale
    return out


def _rank(rank: int, port: int, cases: list, out: dict) -> None:
    from flashinfra.parallel.groups import destroy_distributed, init_distributed, make_comms
    from flashinfra.parallel.load import load_shard, random_shard
    from flashinfra.parallel.shard import shard_loaded

    torch.set_num_threads(1)
    init_distributed(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", timeout_s=120)
    try:
        for key, source, quantization, spec, tp, ep in cases:
            cfg = random_model_config() if source == "random" else load_config(source)
            layout = make_layout(cfg.text, tp, ep, rank)
            comms = make_comms(layout)
            if source == "random":
                model = random_shard(cfg, layout, comms, DTYPE, "cpu", 7, quantization, spec)
            else:
                model = load_shard(source, layout, comms, DTYPE, "cpu", quantization, spec)
                whole = load_model(source, DTYPE, quantization=quantization, cache_spec=spec)
                want = _weights(shard_loaded(whole, layout, ParallelComms.local()).model)
                got = _weights(model.model)
                assert sorted(got) == sorted(want), key
                bad = [n for n in want if not torch.equal(got[n], want[n])]
                assert not bad, (key, rank, bad[:5])
            assert model.quantization == quantization
            out[(key, rank)] = [t.clone() for t in model.logits(PROMPTS)]
    finally:
        destroy_distributed()


def random_model_config():
    from flashinfra.config import resolve_config
    from flashinfra.model.factory import TINY_TEXT_CONFIG

    return resolve_config({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                           "text_config": {**TINY_TEXT_CONFIG, **ALIGNED, "model_type": "glm5_next_text"}})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("q8tp")
    tiny = write_tiny_checkpoint(root / "tiny", tokenizer=False, **ALIGNED)
    return {"tiny": tiny, "tiny_fp8": quantize_checkpoint(tiny, root / "tiny_fp8", "fp8"),
            "default": default_model_dir(), "default_w8a8": quantize_checkpoint(default_model_dir(), root / "w8a8")}


def _cases(checkpoints) -> list:
    cases = []
    for tp, ep in LAYOUTS:
        cases += [((name, tp, ep), str(checkpoints[src]), q, spec, tp, ep) for name, src, q, spec in (
            ("fp8 checkpoint", "tiny_fp8", "fp8", CacheSpec("int8", "bfloat16")),
            ("--quantization fp8", "tiny", "fp8", CacheSpec("fp8", "bfloat16")))]
    cases += [(("w8a8 checkpoint", 2, 2), str(checkpoints["default_w8a8"]), "w8a8", CacheSpec(), 2, 2),
              (("--quantization w8a8", 2, 1), str(checkpoints["default"]), "w8a8", CacheSpec("int8"), 2, 1),
              (("random fp8", 2, 2), "random", "fp8", CacheSpec("fp8"), 2, 2)]
    return cases


def _one_rank(source: str, quantization: str, spec: CacheSpec) -> list[torch.Tensor]:
    if source == "random":
        return random_model(random_model_config(), DTYPE, "cpu", 7, quantization, spec).logits(PROMPTS)
    return load_model(source, DTYPE, quantization=quantization, cache_spec=spec).logits(PROMPTS)


def test_8bit_shards_match_one_rank(checkpoints):
    cases = _cases(checkpoints)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(_free_port(), cases, out), nprocs=2, join=True)
        out = dict(out)
    for key, source, quantization, spec, tp, ep in cases:
        ref = _one_rank(source, quantization, spec)
        scale = max(t.abs().max().item() for t in ref)
        if quantization == "w8a8":  # one rank's W8A8 against the float model it rounds
            exact = _one_rank(str(checkpoints["default"]), "none", CacheSpec())
            q_rel, q_agree = _rel(ref, exact), _agree(ref, exact)
        for rank in range(2):
            got = out[(key, rank)]
            if quantization == "fp8":
                err = max((g - w).abs().max().item() for g, w in zip(got, ref))
                assert err <= 1e-5 * scale, (key, rank, err / scale)
            else:  # activation scales per slice: two W8A8 roundings of the float model, each about as far from it
                # as one rank's, so at most twice that apart; and where both argmaxes are the float one's, equal
                rel, agree = _rel(got, ref), _agree(got, ref)
                assert rel < 2 * q_rel and agree >= 2 * q_agree - 1, (key, rank, rel, q_rel, agree, q_agree)


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want))


def _agree(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return min(float((g.argmax(-1) == w.argmax(-1)).float().mean()) for g, w in zip(got, want))


def test_fp8_split_through_a_block_is_refused(tmp_path):
    # experts 128 wide: at TP 2 each rank's gate rows are 64 of a 128-row block
    path = write_tiny_checkpoint(tmp_path, tokenizer=False, **{**ALIGNED, "moe_intermediate_size": 128})
    with pytest.raises(LayoutError, match=r"layers\.1\.mlp\.experts gate\|up: a piece of 64 rows per rank"):
        check_layout(EngineConfig(model=str(path), tensor_parallel_size=2, quantization="fp8"))
    # whole experts under EP, but the shared expert is split: 64 of its 128 rows per rank
    with pytest.raises(LayoutError, match=r"layers\.1\.mlp\.shared_experts gate\|up"):
        check_layout(EngineConfig(model=str(path), tensor_parallel_size=2, expert_parallel_size=2,
                                  quantization="fp8"))
    check_layout(EngineConfig(model=str(path), tensor_parallel_size=2, quantization="w8a8"))  # any row or column
