"""KDA (Kimi Delta Attention) kernels: the ops the model's KDA layer calls.

- ``kda_prefill`` / ``kda_prefill_gated``: chunked prefill over packed variable-length sequences, reading and
  writing each sequence's recurrent state in its slot (``prefill``).
- ``kda_layer_decode``: one decode token per sequence, the whole layer between its projections fused (``decode``).
- ``causal_conv1d_prefill`` / ``causal_conv1d_decode``: the short causal conv over q|k|v with its state (``conv``);
  ``causal_conv1d_save_windows``: its state at prefix checkpoints inside a prefill (``checkpoints``).
- ``kda_transition`` / ``kda_summary_gated``: the map ``M`` (and ``H``) of ``S_out = M S_in + H`` over a token range,
  which context parallelism chains across ranks (``chain``).

Each op runs its Triton kernels on CUDA (or under ``TRITON_INTERPRET=1``) and its pure-PyTorch reference
elsewhere.
"""

from flashinfra.kernels.kda.conv import causal_conv1d_decode, causal_conv1d_prefill, causal_conv1d_save_windows
from flashinfra.kernels.kda.decode import kda_layer_decode
from flashinfra.kernels.kda.prefill import kda_prefill, kda_prefill_gated

__all__ = ["causal_conv1d_decode", "causal_conv1d_prefill", "causal_conv1d_save_windows", "kda_layer_decode",
           "kda_prefill", "kda_prefill_gated"]
