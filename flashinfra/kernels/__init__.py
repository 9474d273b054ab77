"""Kernels: pure functions on tensors.

One file per op. Each holds the Triton kernel(s) (``*_kernel``), a launcher, the public op, and a
pure-PyTorch ``*_ref`` that defines what the op computes. The op runs the kernel on CUDA tensors and the
reference elsewhere (or everywhere when ``FLASHINFRA_REFERENCE=1``). Kernels import nothing from the
model or configs. An op family with several files is a package whose ``__init__`` exports its ops:
``kda`` (KDA and its short conv), ``quant`` (the 8-bit kernels).
"""
