"""Where each of our parameters comes from in a checkpoint.

Our layout fuses what runs together (q|k|v|gate inputs into one GEMM, gate|up into one tensor, experts
stacked); checkpoints store the release layout (per-tensor, per-expert). For every parameter this module
lists one or more *forms*: each form is a list of ``Copy(name, index, shape)`` instructions — read
checkpoint tensor ``name`` (which must have ``shape``) into ``param[index]``. The first form whose
tensors are all present is used; the first form is the release layout, which the tiny-model factory
writes. Names are relative to the text model's prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.config import TextConfig


@dataclass(frozen=True)
class Copy:
    name: str
    index: tuple  # index into the destination parameter; () = the whole parameter
    shape: tuple[int, ...]  # the checkpoint tensor's expected shape


Form = list[Copy]


def _rows(names_widths: list[tuple[str, int]], cols: tuple[int, ...], prefix: str) -> Form:
    """Concatenation along dim 0: each tensor fills the next ``width`` rows."""
    out, r = [], 0
    for name, width in names_widths:
        out.append(Copy(prefix + name, (slice(r, r + width),), (width, *cols)))
        r += width
    return out


def _whole(name: str, param: torch.Tensor) -> Form:
    return [Copy(name, (), tuple(param.shape))]


def _experts_w13(p: str, E: int, I: int, D: int) -> list[Form]:
    per_expert = []
    for e in range(E):
        per_expert.append(Copy(f"{p}mlp.experts.{e}.gate_proj.weight", (e, slice(0, I)), (I, D)))
        per_expert.append(Copy(f"{p}mlp.experts.{e}.up_proj.weight", (e, slice(I, 2 * I)), (I, D)))
    return [per_expert, [Copy(f"{p}mlp.experts.gate_up_proj", (), (E, 2 * I, D))]]


def _experts_w2(p: str, E: int, I: int, D: int) -> list[Form]:
    per_expert = [Copy(f"{p}mlp.experts.{e}.down_proj.weight", (e,), (D, I)) for e in range(E)]
    return [per_expert, [Copy(f"{p}mlp.experts.down_proj", (), (E, D, I))]]


def _kda(p: str, cfg: TextConfig, params: dict[str, torch.Tensor], q: str) -> dict[str, list[Form]]:
    H, K, D, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.hidden_size, cfg.linear_conv_kernel_dim
    HK = H * K
    a = f"{p}self_attn."

    def gate_names(name: str) -> list[str]:  # release name, then transformers' in-memory name
        return [f"{a}{name}", f"{a}forget_gate.{name}"]

    out: dict[str, list[Form]] = {}
    out[q + "in_proj"] = [
        _rows([("q_proj.weight", HK), ("k_proj.weight", HK), ("v_proj.weight", HK), (f_a, K),
               ("g_a_proj.weight", K), ("b_proj.weight", H)], (D,), a)
        for f_a in ("f_a_proj.weight", "forget_gate.f_a_proj.weight")
    ]
    out[q + "conv_weight"] = [
        [Copy(f"{a}{x}_conv1d.weight", (slice(i * HK, (i + 1) * HK),), (HK, 1, W)) for i, x in enumerate("qkv")],
        [Copy(f"{a}conv1d.weight", (), (3 * HK, 1, W))],
    ]
    out[q + "fg_b_proj"] = [[Copy(n + ".weight", (0,), (HK, K)), Copy(f"{a}g_b_proj.weight", (1,), (HK, K))]
                            for n in gate_names("f_b_proj")]
    out[q + "dt_bias"] = [[Copy(n, (), (HK,))] for n in gate_names("dt_bias")]
    out[q + "A_log"] = [[Copy(n, (), (H,))] for n in gate_names("A_log")]
    out[q + "o_norm"] = [_whole(f"{a}o_norm.weight", params[q + "o_norm"])]
    out[q + "o_proj"] = [_whole(f"{a}o_proj.weight", params[q + "o_proj"])]
    return out


def _mla(p: str, cfg: TextConfig, params: dict[str, torch.Tensor], q: str, layer: int) -> dict[str, list[Form]]:
    a, D = f"{p}self_attn.", cfg.hidden_size
    out: dict[str, list[Form]] = {}
    qa, kva = cfg.q_lora_rank, cfg.kv_lora_rank
    out[q + "qkv_a_proj"] = [_rows([("q_a_proj.weight", qa), ("kv_a_proj_with_mqa.weight", kva)], (D,), a)]
    if cfg.attention_bias:
        out[q + "qkv_a_bias"] = [_rows([("q_a_proj.bias", qa), ("kv_a_proj_with_mqa.bias", kva)], (), a)]
        out[q + "o_bias"] = [_whole(f"{a}o_proj.bias", params[q + "o_bias"])]
    for ours, theirs in (("q_a_norm", "q_a_layernorm.weight"), ("kv_a_norm", "kv_a_layernorm.weight"),
                         ("q_b_proj", "q_b_proj.weight"), ("kv_b_proj", "kv_b_proj.weight"),
                         ("o_proj", "o_proj.weight")):
        out[q + ours] = [_whole(a + theirs, params[q + ours])]
    if cfg.indexer_types[layer] == "full":
        i, x = f"{a}indexer.", q + "indexer."
        Di, Hi = cfg.index_head_dim, cfg.index_n_heads
        out[x + "x_proj"] = [_rows([("wk.weight", Di), ("index_kpool_compress_gate", Di),
                                    ("weights_proj.weight", Hi)], (D,), i)]
        for ours, theirs in (("wq_b", "wq_b.weight"), ("k_norm_weight", "k_norm.weight"),
                             ("k_norm_bias", "k_norm.bias"), ("pool_ape", "index_kpool_compress_ape")):
            out[x + ours] = [_whole(i + theirs, params[x + ours])]
    return out


def _mlp(p: str, cfg: TextConfig, params: dict[str, torch.Tensor], q: str, layer: int) -> dict[str, list[Form]]:
    D = cfg.hidden_size
    out: dict[str, list[Form]] = {}
    if cfg.mlp_layer_types[layer] == "sparse":
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        Is = I * cfg.n_shared_experts
        out[q + "router_weight"] = [[Copy(f"{p}mlp.gate.weight", (), (E, D))]]
        out[q + "router_bias"] = [[Copy(f"{p}mlp.gate.e_score_correction_bias", (), (E,))]]
        out[q + "w13"] = _experts_w13(p, E, I, D)
        out[q + "w2"] = _experts_w2(p, E, I, D)
        s = f"{p}mlp.shared_experts."
        out[q + "shared.gate_up_proj"] = [_rows([("gate_proj.weight", Is), ("up_proj.weight", Is)], (D,), s)]
        out[q + "shared.down_proj"] = [[Copy(s + "down_proj.weight", (), (D, Is))]]
    else:
        I = cfg.intermediate_size
        out[q + "gate_up_proj"] = [_rows([("gate_proj.weight", I), ("up_proj.weight", I)], (D,), f"{p}mlp.")]
        out[q + "down_proj"] = [[Copy(f"{p}mlp.down_proj.weight", (), (D, I))]]
    return out


def weight_layout(cfg: TextConfig, params: dict[str, torch.Tensor], prefix: str,
                  head_name: str | None) -> dict[str, list[Form]]:
    """Every parameter of ``Glm5NextModel`` -> its forms. ``params`` maps our names to tensors."""
    out: dict[str, list[Form]] = {
        "embed_tokens": [_whole(prefix + "embed_tokens.weight", params["embed_tokens"])],
        "norm": [_whole(prefix + "norm.weight", params["norm"])],
    }
    if head_name is not None:
        out["lm_head"] = [_whole(head_name, params["lm_head"])]
    n = cfg.hc_mult
    for i in range(cfg.num_hidden_layers):
        p, q = f"{prefix}layers.{i}.", f"layers.{i}."
        out[q + "input_norm"] = [_whole(p + "input_layernorm.weight", params[q + "input_norm"])]
        out[q + "post_attn_norm"] = [_whole(p + "post_attention_layernorm.weight", params[q + "post_attn_norm"])]
        for hc in ("attn", "ffn"):
            for part, shape in (("fn", ((2 + n) * n, n * cfg.hidden_size)), ("base", ((2 + n) * n,)), ("scale", (3,))):
                out[f"{q}{hc}_hc.{part}"] = [[Copy(f"{p}hc_{hc}_{part}", (), shape)],
                                            [Copy(f"{p}{hc}_hc.{part}", (), shape)]]
        if i in cfg.kda_layers:
            out.update(_kda(p, cfg, params, q + "attn."))
        else:
            out.update(_mla(p, cfg, params, q + "attn.", i))
        out.update(_mlp(p, cfg, params, q + "mlp.", i))
    missing = set(params) - set(out)
    if missing:
        raise AssertionError(f"weight layout lacks parameters {sorted(missing)}")
    return out
