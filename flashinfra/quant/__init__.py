"""Quantization: how a weight or cache tensor is stored (dtype + scales + layout), declared once and read by the
kernels.

- ``weights.py``: ``QuantizedWeight`` (int8 per output channel for W8A8, e4m3 per 128x128 block for FP8) and the
  quantizers that make one from a float tensor, with their exact dequantization.
- ``linear.py``: ``linear`` and ``moe_experts``, the calls the model's projections make; they dispatch on the
  weight (a float tensor or a ``QuantizedWeight``) to the matching kernel op.
- ``model.py``: quantizing a loaded model in place (which parameters, which stay bf16) and the refusals of bad
  combinations (a checkpoint's format against ``--quantization``).
- ``cache.py``: the cache dtypes (MLA latent in bf16 / fp8 / int8 with per-token scales, KDA state in fp32 or
  bf16, per-layer overrides), quantize-on-write and dequantize-on-read, and tokens per GiB.
- ``slicing.py``: a weight's rows, columns or experts with the scales that cover them: a tensor-parallel rank's
  slice of the one-rank quantization (FP8 slices keep whole blocks or are refused).
- ``checkpoint.py``: ``flashinfra quantize --w8a8|--fp8 SRC DST``.

The arithmetic lives in the kernels: ``flashinfra.kernels.quant`` (``act``, ``gemm``) and, with
the 8-bit formats as a constexpr of the op's one kernel, ``kernels.fused_moe``, ``kernels.sparse_mla`` and
``kernels.dsa_indexer``; each kernel has its reference beside it.
"""
