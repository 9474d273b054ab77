"""Quantized kernels on a CUDA device at GLM-5.3-Flash sizes (bf16 activations) against float64 references of the
same quantized arithmetic and against the unquantized product. The fp8 kernels need sm_89 or newer."""

import pytest
import torch

from flashinfra.feedback.registry import assert_passed
from flashinfra.kernels import check_cases as hotpath
from flashinfra.kernels.quant import check_cases as cases
from tests.kernels import model_cases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16


def _fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("T,K", [(1, 4096), (33, 4096), (1000, 4096), (1, 16384), (3, 20000)])
def test_quant_act(T, K):
    assert_passed(cases.quant_act("cuda", T, K, dtype=BF16, seed=T))


@pytest.mark.parametrize("T,D", [(1, 4096), (33, 1536), (1000, 4096), (7, 6144)])
def test_rms_norm_int8(T, D):
    assert_passed(cases.norm_int8("cuda", T, D, dtype=BF16, seed=T))


def test_w8a8_norm_fusion_leaves_the_kernels_logits_unchanged(tmp_path, monkeypatch):
    model_cases.w8a8_norm_fusion_leaves_logits_unchanged(tmp_path, monkeypatch, "cuda", kernels=True)


# decode rows at narrow outputs (32- and 16-column tiles) and wide ones, then prompt-sized
@pytest.mark.parametrize("T,K,N", [(1, 4096, 12288), (1, 8192, 4096), (5, 4096, 2048), (32, 4096, 1536),
                                   (1000, 8192, 4096), (63, 1536, 16384)])
def test_w8a8_linear(T, K, N):
    assert_passed(cases.linear("cuda", "w8a8", T, K, N, dtype=BF16, seed=T))


@pytest.mark.skipif(not _fp8_ok(), reason="fp8 tensor cores need sm_89+")
@pytest.mark.parametrize("T,K,N", [(1, 4096, 12288), (32, 4096, 1536), (1000, 8192, 4096)])
def test_fp8_block_linear(T, K, N):
    assert_passed(cases.linear("cuda", "fp8", T, K, N, dtype=BF16, seed=T))


@pytest.mark.parametrize("T", [1, 32, 1024])
def test_w8a8_moe(T):
    # 64 experts: the float64 reference fits
    assert_passed(cases.moe("cuda", "w8a8", T, 64, 4096, 2048, 8, dtype=BF16, seed=T))


@pytest.mark.skipif(not _fp8_ok(), reason="fp8 tensor cores need sm_89+")
@pytest.mark.parametrize("T", [1, 32, 1024])
def test_fp8_moe(T):
    assert_passed(cases.moe("cuda", "fp8", T, 64, 4096, 2048, 8, dtype=BF16, seed=T))


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("ctx,qlens", [([0, 100, 3000], [300, 1, 1]), ([4000] * 32, [1] * 32)])
def test_sparse_mla_quant(cache_dtype, ctx, qlens):
    if cache_dtype == "fp8" and not _fp8_ok():
        pytest.skip("fp8 needs sm_89+")
    assert_passed(hotpath.sparse_mla("cuda", ctx, qlens, cache=cache_dtype, H=64, R=512, bs=64, S=2048 + 3,
                                     dtype=BF16))


# The whole quantized model's kernel path against its reference path is compared under the CPU interpreter
# (tests/kernels/interpret_quant.py), where both round alike. On the GPU the two paths round differently even
# unquantized (tf32 in-chunk products of the float32 KDA path), and a random MoE model amplifies that through
# routing flips: on an H200 the unquantized tiny model's prefill logits differ by 2.5% between the paths, and the
# argmax-fed decode steps diverge. So on the GPU each 8-bit kernel is checked alone (above), and the model through
# CUDA-graph replay against eager (below).


@pytest.mark.skipif(not _fp8_ok(), reason="fp8 needs sm_89+")
@pytest.mark.parametrize("ctx,qlens", [([0, 100, 3000], [300, 1, 1]), ([4000] * 8, [1] * 8)])
def test_dsa_select_quant(ctx, qlens):
    assert_passed(hotpath.dsa_select("cuda", ctx, qlens, Hi=32, Di=128, kpool=4, topk=2048, bs=64, fp8=True,
                                     dtype=BF16))


@pytest.mark.parametrize("quantization,kv", [("w8a8", "int8"), ("fp8", "fp8")])
def test_quantized_decode_graph_replay_equals_eager(tmp_path, quantization, kv):
    """CUDA-graph decode steps of a quantized model over an 8-bit cache equal the eager steps (the quantize-on-write
    and the activation quantization are captured with the rest)."""
    if "fp8" in (quantization, kv) and not _fp8_ok():
        pytest.skip("fp8 needs sm_89+")
    from flashinfra.engine.cuda_graphs import DecodeGraphs
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.model.forward_batch import ForwardBatch
    from flashinfra.quant.cache import CacheSpec

    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=3, tokenizer=False), dtype="bfloat16",
                       device="cuda", quantization=quantization, cache_spec=CacheSpec.from_flags(kv))
    bs, steps = 16, 6
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (5, 37, 1, 20)]
    need = [-(-(len(p) + steps) // bs) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(prompts))]
    nblocks, nseq = sum(need), len(prompts)
    caches = [model.allocate_cache(nblocks + 1, bs, nseq + 1) for _ in range(2)]
    batch = ForwardBatch.build([len(p) for p in prompts], [0] * nseq, list(range(nseq)), tables, bs, "cuda")
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    for cache in caches:
        hidden = model.forward(ids, batch, cache)
    last = model.compute_logits(hidden[torch.tensor(batch.last_token_indices, device="cuda")]).argmax(-1)
    lens = [len(p) for p in prompts]
    graphs = DecodeGraphs(model, caches[1], scratch_block=nblocks, scratch_slot=nseq)
    for step in range(steps):
        batch = ForwardBatch.build([1] * nseq, [n + step for n in lens], list(range(nseq)), tables, bs, "cuda")
        eager = model.forward(last, batch, caches[0])
        replay = graphs.run(last, batch)
        err = float((replay.float() - eager.float()).norm() / eager.float().norm())
        assert err < 1e-2, f"step {step}: graph vs eager {err}"
        last = model.compute_logits(eager).argmax(-1)
    for layer, scale in caches[0].mla_latent_scale.items():  # the real blocks' scales were written alike
        assert torch.allclose(scale[:nblocks], caches[1].mla_latent_scale[layer][:nblocks], rtol=2e-2, atol=1e-6)
