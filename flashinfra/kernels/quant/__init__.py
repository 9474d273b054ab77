"""8-bit kernels: the ops ``flashinfra.quant`` and the model call on quantized weights and caches.

- ``quant_int8_per_token`` / ``quant_fp8_per_group``: activation quantization, per token (int8) or per token per
  128 channels (e4m3) (``act``).
- ``w8a8_linear``: int8 activations times int8 per-channel weights (``w8a8_gemm``).
- ``fp8_block_linear``: e4m3 activations times e4m3 weights with 128 x 128 block scales (``fp8_gemm``).
- ``w8a8_moe`` / ``fp8_moe``: the fused MoE experts on those operands (``w8a8_experts``, ``fp8_experts``).
- ``sparse_mla_quant`` / ``sparse_mla_quant_launch``: sparse MLA attention reading an 8-bit latent cache
  (``sparse_mla``).
- ``dsa_select_quant``: the DSA top-k selection over an fp8 indexer cache (``dsa_indexer``).

Each op runs its Triton kernels on CUDA (or under ``TRITON_INTERPRET=1``) and its float64 reference of the same
quantized arithmetic (``*_ref`` beside it) elsewhere. The module names differ from the op names so that importing
an op never hides its module. Checks: ``checks.py`` (``flashinfra check quant``), cases in ``check_cases.py``.
"""

from flashinfra.kernels.quant.act import quant_fp8_per_group, quant_int8_per_token
from flashinfra.kernels.quant.dsa_indexer import dsa_select_quant
from flashinfra.kernels.quant.fp8_experts import fp8_moe
from flashinfra.kernels.quant.fp8_gemm import fp8_block_linear
from flashinfra.kernels.quant.sparse_mla import sparse_mla_quant, sparse_mla_quant_launch
from flashinfra.kernels.quant.w8a8_experts import w8a8_moe
from flashinfra.kernels.quant.w8a8_gemm import w8a8_linear

__all__ = ["dsa_select_quant", "fp8_block_linear", "fp8_moe", "quant_fp8_per_group", "quant_int8_per_token",
           "sparse_mla_quant", "sparse_mla_quant_launch", "w8a8_linear", "w8a8_moe"]
