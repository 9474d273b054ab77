"""The quantizers and the quantized kernels' references on the CPU: each against float64 of the same quantized
arithmetic (exact up to float64 rounding) and against the unquantized float64 computation (stated tolerances)."""

import pytest
import torch

from flashinfra.kernels import sparse_mla as sm
from flashinfra.kernels.fused_moe import experts_ref, fused_moe
from flashinfra.kernels.quant import act as qa
from flashinfra.kernels.quant import gemm as gm
from flashinfra.model.loader import dequantize_block_fp8
from flashinfra.quant.weights import (QuantizedWeight, dequantize_blocks, quantize_fp8_blocks,
                                      quantize_int8_per_channel)
from flashinfra.kernels.quant.check_cases import FP8_REL, INT8_REL, rel_err


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_int8_per_channel_quantizer():
    w = torch.randn(37, 100, generator=_g(0))
    w[3] = 0
    q = quantize_int8_per_channel(w)
    assert q.data.dtype == torch.int8 and q.scale.shape == (37,) and int(q.data.abs().max()) <= 127
    assert float(q.scale[3]) == 1.0 and int(q.data[3].abs().max()) == 0
    assert bool((q.data.abs().amax(-1)[torch.arange(37) != 3] == 127).all())  # the row's max maps to +-127
    err = (q.dequantize(torch.float64) - w.double()).abs()
    assert bool((err <= q.scale.double()[:, None] / 2 + 1e-12).all())  # half a step at most
    stacked = quantize_int8_per_channel(torch.randn(3, 8, 16, generator=_g(1)))
    assert stacked.scale.shape == (3, 8) and stacked[1].data.shape == (8, 16)


def test_fp8_block_quantizer_matches_the_checkpoint_format():
    w = torch.randn(300, 200, generator=_g(2))
    q = quantize_fp8_blocks(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (3, 2)
    # the loader's dequantization of released checkpoints reads our data and scales alike (in float32)
    assert torch.allclose(dequantize_block_fp8(q.data, q.scale, (128, 128)).double(),
                          dequantize_blocks(q.data, q.scale, (128, 128)), rtol=1e-7, atol=0)
    # each block's largest magnitude maps to 448 exactly; e4m3 keeps 3 mantissa bits (relative error <= 2^-4)
    err = (q.dequantize(torch.float64) - w.double()).abs()
    assert bool((err <= w.double().abs() * 2**-4 + q.scale.double().max() * 2**-9).all())
    assert rel_err(q.dequantize(), w) < 0.04


def test_quantized_weight_declares_its_format():
    with pytest.raises(ValueError, match="expected torch.int8"):
        QuantizedWeight(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.ones(2), "w8a8")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        QuantizedWeight(torch.zeros(2, 2, dtype=torch.int8), torch.ones(2), "int4")


def test_activation_quantizers():
    x = torch.randn(9, 300, generator=_g(3))
    q, s = qa.quant_int8_per_token_ref(x)
    assert rel_err(q.double() * s.double()[:, None], x) < 0.01 and int(q.abs().amax()) == 127
    q8, s8 = qa.quant_fp8_per_group_ref(x)
    assert s8.shape == (9, 3)
    deq = q8.double() * s8.double().repeat_interleave(128, 1)[:, :300]
    assert rel_err(deq, x) < 0.04
    assert qa.quant_int8_per_token(x)[0].equal(q)  # the CPU op is the reference


def test_w8a8_matmul_ref_is_integer_exact():
    g = _g(4)
    xq = torch.randint(-127, 128, (7, 300), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (37, 300), generator=g, dtype=torch.int8)
    sx, sw = torch.rand(7, generator=g), torch.rand(37, generator=g)
    exact = (xq.long() @ wq.long().t()).double() * sx.double()[:, None] * sw.double()
    assert torch.equal(gm.matmul_8bit_ref(xq, sx, wq, sw, out_dtype=torch.float64), exact)


@pytest.mark.parametrize("T,K,N", [(1, 64, 48), (13, 300, 37), (70, 1000, 150)])
def test_w8a8_and_fp8_linear_refs_against_the_float_product(T, K, N):
    g = _g(T)
    x, w, b = torch.randn(T, K, generator=g), torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g)
    full = x.double() @ w.double().t() + b.double()
    qi, qf = quantize_int8_per_channel(w), quantize_fp8_blocks(w)
    assert rel_err(gm.linear_8bit(x, qi.data, qi.scale, b), full) < INT8_REL
    assert rel_err(gm.linear_8bit(x, qf.data, qf.scale, b, qf.block), full) < FP8_REL
    # bf16 activations: the same budgets
    assert rel_err(gm.linear_8bit(x.bfloat16(), qi.data, qi.scale, b), full) < INT8_REL + 0.01
    xq, sx = qa.quant_fp8_per_group_ref(x)
    manual = (xq.double() * sx.double().repeat_interleave(128, 1)[:, :K]) @ qf.dequantize(torch.float64).t()
    assert torch.allclose(gm.matmul_8bit_ref(xq, sx, qf.data, qf.scale, out_dtype=torch.float64), manual, rtol=1e-12,
                          atol=1e-12)


@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
def test_moe_refs_against_the_float_experts(scheme):
    g = _g(5)
    T, E, D, I, k = 19, 6, 40, 24, 2
    x = torch.randn(T, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    quantize, bound = ((quantize_int8_per_channel, 2 * INT8_REL) if scheme == "w8a8" else
                       (quantize_fp8_blocks, 1.5 * FP8_REL))
    q13, q2 = quantize(w13), quantize(w2)
    out = fused_moe(x, q13.data, q2.data, w, ids, 10.0, None, None, (q13.scale, q2.scale, None, None))
    assert rel_err(out, experts_ref(x.double(), w13.double(), w2.double(), w.double(), ids, 10.0)) < bound


def test_sparse_mla_ref_on_an_8bit_latent_is_sparse_mla_on_the_dequantized_latent():
    g = _g(6)
    latent = torch.randn(6, 4, 32, generator=g)
    q8, s = qa.quant_int8_per_token_ref(latent.view(-1, 32))
    q8, s = q8.view(6, 4, 32), s.view(6, 4)
    q = torch.randn(5, 3, 32, generator=g, dtype=torch.float64)
    sel = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6], [7, -1, -1, -1], [0, 9, 10, 11], [1, 2, 3, 4]], dtype=torch.int32)
    token_seq = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    tables = torch.tensor([[2, 0, 5], [1, 4, 3]], dtype=torch.int32)
    deq = q8.double() * s.double()[..., None]
    out = sm.sparse_mla(q, q8, sel, token_seq, tables, 0.2, s)
    assert torch.allclose(out, sm.sparse_mla_ref(q, deq, sel, token_seq, tables, 0.2), rtol=1e-5, atol=1e-6)
