"""8-bit kernels of their own: activation quantization and the dense 8-bit GEMM.

- ``quant_int8_per_token`` / ``quant_fp8_per_group``: activation quantization, per token (int8) or per token per
  128 channels (e4m3) (``act``).
- ``rms_norm_int8``: the RMSNorm with the int8 per-token quantization of its output in its epilogue, for the W8A8
  projections the norm feeds (``norm_act``).
- ``linear_8bit``: int8 activations times int8 per-channel weights (W8A8), or e4m3 activations times e4m3 weights
  with 128 x 128 block scales, in one kernel (``gemm``); ``matmul_8bit`` the same on activations already
  quantized (by ``rms_norm_int8``).

The ops that also run on float operands take the 8-bit formats as a constexpr of their one kernel, read from the
tensors' dtypes: ``kernels.fused_moe`` (int8 and fp8 experts), ``kernels.sparse_mla`` (an int8 or fp8 latent
cache), ``kernels.dsa_indexer`` (an fp8 indexer cache). Each op runs its Triton kernels on CUDA (or under
``TRITON_INTERPRET=1``) and its float64 reference of the same quantized arithmetic (``*_ref`` beside it)
elsewhere. Checks of every 8-bit path: ``checks.py`` (``flashinfra check quant``), cases in ``check_cases.py``.
"""

from flashinfra.kernels.quant.act import quant_fp8_per_group, quant_int8_per_token
from flashinfra.kernels.quant.gemm import linear_8bit, matmul_8bit
from flashinfra.kernels.quant.norm_act import rms_norm_int8

__all__ = ["linear_8bit", "matmul_8bit", "quant_fp8_per_group", "quant_int8_per_token", "rms_norm_int8"]
