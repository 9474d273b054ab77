"""KDA (Kimi Delta Attention) layer: linear attention with a per-channel forget gate.

One input GEMM gives q|k|v, the forget-gate and output-gate low-rank inputs and beta's logits; a short
causal conv with SiLU runs over q|k|v; the delta-rule recurrence runs over each sequence from its state
slot; a gated RMSNorm and the output projection finish. Decode batches run all of that between the two
projections as one fused op; any other batch (fresh prefills, chunks, mixed) runs the conv, the chunked
recurrence (gate, beta and q/k L2 norm fused in) and the norm; the conv and recurrent states at the batch's
prefix checkpoints go to their slots on the way.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flashinfra.config import TextConfig
from flashinfra.kernels.batch_invariant import matmul_nt
from flashinfra.kernels.dispatch import is_deterministic
from flashinfra.kernels.kda import (causal_conv1d_prefill, causal_conv1d_save_windows, kda_layer_decode,
                                   kda_prefill_gated)
from flashinfra.kernels.norms import gated_rms_norm
from flashinfra.model.cache import ModelCache
from flashinfra.model.forward_batch import ForwardBatch
from flashinfra.quant.linear import linear


class KDAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        H, K, D = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size
        self.layer, self.H, self.K = layer, H, K
        self.lower_bound, self.eps = cfg.linear_lower_bound, cfg.rms_norm_eps
        self.splits = [3 * H * K, K, K, H]  # q|k|v, forget-gate input, output-gate input, beta logits

        def param(*shape, dt=dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dt), requires_grad=False)

        self.in_proj = param(sum(self.splits), D)
        self.conv_weight = param(3 * H * K, cfg.linear_conv_kernel_dim, dt=torch.float32)
        self.fg_b_proj = param(2, H * K, K)  # the forget gate's and the output gate's low-rank up-projections
        self.dt_bias = param(H * K, dt=torch.float32)
        self.A_log = param(H, dt=torch.float32)
        self.o_norm = param(K)
        self.o_proj = param(D, H * K)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q|k|v before the conv [T, 3 H K], the forget gate's input [T, H K], beta's logits [T, H]
        and the output gate before its sigmoid [T, H K]."""
        qkv, fg_a, b = linear(x, self.in_proj).split([self.splits[0], 2 * self.K, self.splits[3]], dim=-1)
        # both gates' up-projections as one batched product, from the adjacent f_a | g_a columns as they are
        f, g = matmul_nt(fg_a.unflatten(-1, (2, self.K)).transpose(0, 1), self.fg_b_proj).unbind(0)
        return qkv, f, b, g

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        T, H, K = x.shape[0], self.H, self.K
        qkv, g_raw, b, gate = self.project(x)
        conv_state, state = cache.conv_state[self.layer], cache.recurrent_state[self.layer]
        if any(batch.replay):
            return linear(self._forward_replay(qkv, g_raw, b, gate, batch, cache).reshape(T, H * K), self.o_proj)
        if is_deterministic() and not batch.is_decode and any(self._decode_rows(batch)):
            return linear(self._forward_mixed(qkv, g_raw, b, gate, batch, cache).reshape(T, H * K), self.o_proj)
        if batch.is_decode:
            o = kda_layer_decode(qkv, self.conv_weight, conv_state, g_raw, b, gate, self.A_log, self.dt_bias,
                                 self.lower_bound, self.o_norm, self.eps, state, batch.state_slots_t)
            return linear(o.reshape(T, H * K), self.o_proj)
        slots, has_init, cu = list(batch.state_slots), batch.has_initial_state, batch.cu_seqlens_list
        causal_conv1d_save_windows(qkv, conv_state, cu, slots, has_init, batch.checkpoints)
        qkv = causal_conv1d_prefill(qkv, self.conv_weight, conv_state, cu, slots, has_init)
        q, k, v = qkv.view(T, 3, H, K).unbind(1)
        o = kda_prefill_gated(q, k, v, g_raw.view(T, H, K), b, self.A_log, self.dt_bias, self.lower_bound, state,
                              cu, slots, has_init, batch.checkpoints)
        o = gated_rms_norm(o, gate.view(T, H, K), self.o_norm, self.eps)
        return linear(o.reshape(T, H * K), self.o_proj)

    @staticmethod
    def _decode_rows(batch: ForwardBatch) -> list[bool]:
        return [q == 1 and c > 0 for q, c in zip(batch.query_lens, batch.context_lens)]

    def _forward_mixed(self, qkv, g_raw, b, gate, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Deterministic mode, a batch mixing decode tokens and prefill pieces: each decode token runs the decode
        op, as it would in a decode-only batch, and the pieces the chunked prefill (an op per kind of row)."""
        conv_state, state = cache.conv_state[self.layer], cache.recurrent_state[self.layer]
        cu, decode = batch.cu_seqlens_list, self._decode_rows(batch)
        out = torch.empty(qkv.shape[0], self.H, self.K, dtype=qkv.dtype, device=qkv.device)
        rows = [i for i, d in enumerate(decode) if d]
        idx = torch.tensor([cu[i] for i in rows], device=qkv.device)
        slots = torch.tensor([batch.state_slots[i] for i in rows], dtype=torch.int64, device=qkv.device)
        out[idx] = kda_layer_decode(qkv[idx], self.conv_weight, conv_state, g_raw[idx], b[idx], gate[idx], self.A_log,
                                    self.dt_bias, self.lower_bound, self.o_norm, self.eps, state, slots)
        self._prefill_rows([i for i, d in enumerate(decode) if not d], qkv, g_raw, b, gate, batch, cache, out)
        return out

    def _forward_replay(self, qkv, g_raw, b, gate, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """Speculative verify: the ``batch.replay`` sequences run from their checkpoints into the ReplaySSM
        ring (the state is written later, by the fold of the accepted tokens); the others as a prefill."""
        from flashinfra.model.replay import kda_layer_verify

        conv_state, state = cache.conv_state[self.layer], cache.recurrent_state[self.layer]
        if all(batch.replay):  # the batch's own rows and device tensors: nothing from the host (a CUDA graph's path)
            return kda_layer_verify(qkv, self.conv_weight, conv_state, g_raw, b, gate, self.A_log, self.dt_bias,
                                    self.lower_bound, self.o_norm, self.eps, state, cache.replay[self.layer],
                                    list(batch.state_slots), batch.cu_seqlens_list,
                                    device_rows=(batch.state_slots_t, batch.cu_seqlens))
        out = torch.empty(qkv.shape[0], self.H, self.K, dtype=qkv.dtype, device=qkv.device)
        idx, sub, slots = self._rows(batch, [i for i, r in enumerate(batch.replay) if r], qkv.device)
        out[idx] = kda_layer_verify(qkv[idx], self.conv_weight, conv_state, g_raw[idx], b[idx], gate[idx], self.A_log,
                                    self.dt_bias, self.lower_bound, self.o_norm, self.eps, state,
                                    cache.replay[self.layer], slots, sub)
        self._prefill_rows([i for i, r in enumerate(batch.replay) if not r], qkv, g_raw, b, gate, batch, cache, out)
        return out

    @staticmethod
    def _rows(batch: ForwardBatch, seqs: list[int], device) -> tuple[torch.Tensor, list[int], list[int]]:
        """The token indices of sequences ``seqs``, their cumulative lengths from 0, and their state slots."""
        cu = batch.cu_seqlens_list
        idx = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in seqs]).to(device)
        sub = [0]
        for i in seqs:
            sub.append(sub[-1] + cu[i + 1] - cu[i])
        return idx, sub, [batch.state_slots[i] for i in seqs]

    def _prefill_rows(self, seqs: list[int], qkv, g_raw, b, gate, batch: ForwardBatch, cache: ModelCache,
                      out: torch.Tensor) -> None:
        """The chunked prefill of sequences ``seqs`` of the batch alone (their prefix checkpoints included),
        written into their rows of ``out``."""
        if not seqs:
            return
        H, K = self.H, self.K
        conv_state, state = cache.conv_state[self.layer], cache.recurrent_state[self.layer]
        idx, sub, slots = self._rows(batch, seqs, qkv.device)
        has_init = [batch.has_initial_state[i] for i in seqs]
        ckpts = [(seqs.index(n), p, dst) for n, p, dst in batch.checkpoints if n in seqs]
        causal_conv1d_save_windows(qkv[idx], conv_state, sub, slots, has_init, ckpts)
        x = causal_conv1d_prefill(qkv[idx], self.conv_weight, conv_state, sub, slots, has_init)
        q, k, v = x.view(-1, 3, H, K).unbind(1)
        o = kda_prefill_gated(q, k, v, g_raw[idx].view(-1, H, K), b[idx], self.A_log, self.dt_bias,
                              self.lower_bound, state, sub, slots, has_init, ckpts)
        out[idx] = gated_rms_norm(o, gate[idx].view(-1, H, K), self.o_norm, self.eps)
