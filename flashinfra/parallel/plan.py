"""``flashinfra plan``: will this model fit on N GPUs with this TP/EP, weight dtype and cache dtypes, and how
much cache?

The answer comes from the model itself: the full model is built on the ``meta`` device (no memory),
quantized by the engine's own ``quant.model.quantize_model`` and sharded for rank 0 by the same
``shard_parameters`` the engine uses, and its weights counted, so the per-rank bytes follow every
quantization and sharding rule without a second copy of them. Weight dtypes:

- ``bf16``: every weight as the model declares it (bf16, float32 where the model keeps float32:
  router, conv, gates' biases, mHC scalars).
- ``fp8``: the projections ``quant.model.QUANTIZED`` names in e4m3 plus one float32 scale per
  ``[128, 128]`` block (the released checkpoint's format); what the engine keeps in bf16 stays so.
- ``int8``: the same projections in int8 plus one float32 scale per output row (W8A8, per channel).

Cache per rank, in the dtypes ``--kv-cache-dtype`` / ``--kda-state-dtype`` choose (``quant.cache``): the MLA
latent and indexer keys are replicated on every rank (see ``shard.py``), so the tokens that fit do not grow
with TP; the KDA state slots hold ``H / tp`` heads. The MTP block and the vision tower are not counted
(neither is loaded by the text engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GLM_5_3_FLASH = {  # the released config.json's text values (DESIGN.md), for sizing without the checkpoint
    "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 45, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 256,
        "qk_rope_head_dim": 0, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "index_kpool": 4, "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "swiglu_limit": 10.0,
        "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "layer_types": ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42,
    },
}
PRESETS = {"glm-5.3-flash": GLM_5_3_FLASH}
WEIGHT_DTYPES = {"bf16": "none", "fp8": "fp8", "int8": "w8a8"}  # --dtype -> the engine's weight mode
GPU_MEMORY_BYTES = 141 * 10**9  # H200


@dataclass
class RankPlan:
    gpus: int
    tp: int
    ep: int
    weight_dtype: str
    kv_cache_dtype: str
    kda_state_dtype: str
    weight_bytes_per_rank: int
    sharded_bytes_per_rank: int
    replicated_bytes_per_rank: int
    weight_bytes_total: int  # the unsharded model in this dtype
    kda_state_bytes_per_seq: int  # per rank
    cache_bytes_per_token: int  # per rank (MLA latent + indexer keys, replicated)
    max_num_seqs: int
    usable_bytes_per_rank: int
    cache_tokens: int  # tokens of paged cache that fit beside the weights and the max_num_seqs state slots
    fits: bool
    reason: str


def shard_meta(cfg, layout, mode: str):
    """(rank ``layout.rank``'s model on ``meta``, the whole model's weight bytes by name) in weight mode
    ``mode`` (none, w8a8, fp8): quantized as the loader does, then sliced as the loader does. A split that
    cuts FP8 blocks raises ``LayoutError`` naming the tensor."""
    import torch

    from flashinfra.model.glm5_next import Glm5NextModel
    from flashinfra.parallel.collectives import ParallelComms
    from flashinfra.parallel.shard import named_weight_bytes, shard_parameters
    from flashinfra.quant.model import quantize_model

    with torch.device("meta"):
        model = Glm5NextModel(cfg.text, torch.bfloat16, cfg.has_lm_head)
        if mode != "none":
            quantize_model(model, mode)
        full = named_weight_bytes(model)
        shard_parameters(model, layout, ParallelComms.local())
    return model, full


def check_shards(cfg, layout, quantization: str) -> None:
    """Refuse, before any rank starts, an FP8 layout whose slices would cut 128 x 128 blocks (the other modes
    slice at any row or column)."""
    if quantization == "fp8" and layout.world > 1:
        shard_meta(cfg, layout, "fp8")


def plan(raw_config: dict, gpus: int, tp: int | None = None, ep: int | None = None, weight_dtype: str = "bf16",
         gpu_memory: int = GPU_MEMORY_BYTES, memory_fraction: float = 0.9, reserve: int = 8 * 2**30,
         max_num_seqs: int = 64, min_cache_tokens: int = 65536, kv_cache_dtype: str = "auto",
         kda_state_dtype: str = "float32") -> RankPlan:
    """Size one rank (all ranks hold the same bytes) of ``gpus`` GPUs; ``tp`` defaults to ``gpus``, ``ep``
    to ``tp``. ``usable`` = ``gpu_memory * memory_fraction - reserve`` (activations, graphs, workspace);
    the configuration fits when weights, ``max_num_seqs`` KDA slots and ``min_cache_tokens`` of paged
    cache fit in it. The model dtype is bf16; ``kv_cache_dtype`` / ``kda_state_dtype`` as the engine's flags."""
    import torch

    from flashinfra.config import resolve_config
    from flashinfra.model.cache import ModelCache
    from flashinfra.parallel.layout import make_layout, world_size
    from flashinfra.parallel.shard import named_weight_bytes
    from flashinfra.quant.cache import CacheSpec

    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {weight_dtype!r}: choose one of {', '.join(WEIGHT_DTYPES)}")
    tp = gpus if tp is None else tp
    ep = tp if ep is None else ep
    if world_size(tp, ep) != gpus:
        raise ValueError(f"--tp {tp} and --ep {ep} run on max(tp, ep) = {world_size(tp, ep)} GPUs, not --gpus {gpus}")
    cfg = resolve_config(raw_config)
    spec = CacheSpec(kv_cache_dtype, kda_state_dtype)
    layout = make_layout(cfg.text, tp, ep, 0)
    model, full = shard_meta(cfg, layout, WEIGHT_DTYPES[weight_dtype])
    local = named_weight_bytes(model)
    total = sum(full.values())
    # a weight is replicated when this rank holds all of it (same name, same bytes)
    replicated = sum(b for n, b in local.items() if full.get(n) == b)
    per_rank = sum(local.values())
    text = cfg.text
    local_text = dataclasses.replace(text, linear_num_heads=text.linear_num_heads // tp)
    per_slot = ModelCache.bytes_per_slot(local_text, torch.bfloat16, spec.state_dtype)
    per_token = ModelCache.bytes_per_block(text, 1, torch.bfloat16, spec.latent_dtypes(text.mla_layers, torch.bfloat16))
    usable = int(gpu_memory * memory_fraction) - reserve
    left = usable - per_rank - max_num_seqs * per_slot
    tokens = max(0, left // per_token)
    fits = tokens >= min_cache_tokens
    gib = 2**30
    reason = (f"{per_rank / gib:.1f} GiB weights + {max_num_seqs} KDA slots x {per_slot / 2**20:.1f} MiB leave "
              f"{max(left, 0) / gib:.1f} GiB of {usable / gib:.1f} GiB usable: {tokens} cache tokens"
              + ("" if fits else f", fewer than the {min_cache_tokens} needed"))
    return RankPlan(gpus, tp, ep, weight_dtype, kv_cache_dtype, kda_state_dtype, per_rank, per_rank - replicated,
                    replicated, total, per_slot, per_token, max_num_seqs, usable, int(tokens), fits, reason)


def write_model_dir(raw_config: dict, path: str | Path) -> Path:
    """A model directory without weights for ``--load-format random``: ``raw_config`` as ``config.json`` with the
    built-in model's tokenizer, generation defaults and special token ids (they lie in any larger vocabulary)."""
    import shutil

    from flashinfra.model.factory import default_model_dir

    src, path = default_model_dir(), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ours = json.loads((src / "config.json").read_text())
    ours = ours.get("text_config", ours)
    raw = json.loads(json.dumps(raw_config))
    text = raw.get("text_config", raw)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if key in ours:
            text.setdefault(key, ours[key])
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and f.suffix != ".safetensors":
            shutil.copy2(f, path / f.name)
    return path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="per-GPU weight bytes and cache tokens for a TP/EP configuration")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="checkpoint directory (its config.json is read)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in full-model config")
    p.add_argument("--gpus", type=int, required=True, help="GPUs, one rank each")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: --gpus)")
    p.add_argument("--ep", type=int, default=None,
                   help="expert-parallel size; max(--tp, --ep) is --gpus (default: --tp)")
    p.add_argument("--dtype", choices=WEIGHT_DTYPES, default="bf16", help="weight dtype (default: bf16)")
    p.add_argument("--gpu-memory-gb", type=float, default=GPU_MEMORY_BYTES / 1e9,
                   help="memory of one GPU in GB (default: 141, an H200)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="KDA state slots to hold (default: 64)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "fp8", "int8"), default="auto",
                   help="MLA latent cache dtype, as the engine's flag (default: auto, the bf16 model dtype)")
    p.add_argument("--kda-state-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="KDA recurrent state dtype (default: float32)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--write-model-dir", metavar="DIR",
                   help="also write the config with the built-in tokenizer to DIR, a model to serve with "
                        "--load-format random (no weights downloaded)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashinfra.parallel.layout import LayoutError

    raw = PRESETS[args.preset] if args.preset else json.loads((Path(args.model) / "config.json").read_text())
    try:
        r = plan(raw, args.gpus, args.tp, args.ep, args.dtype, int(args.gpu_memory_gb * 1e9),
                 max_num_seqs=args.max_num_seqs, kv_cache_dtype=args.kv_cache_dtype,
                 kda_state_dtype=args.kda_state_dtype)
    except (LayoutError, ValueError) as e:
        raise SystemExit(f"plan: {e}") from None
    if args.write_model_dir:
        print(f"model directory for --load-format random: {write_model_dir(raw, args.write_model_dir)}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(r), indent=2))
        return 0 if r.fits else 1
    gib = 2**30
    print(f"{r.gpus} GPUs, tp={r.tp} ep={r.ep}, weights {r.weight_dtype}, latent cache {r.kv_cache_dtype}, "
          f"KDA state {r.kda_state_dtype}: "
          f"{'FITS' if r.fits else 'DOES NOT FIT'}")
    print(f"  weights per rank   {r.weight_bytes_per_rank / gib:8.2f} GiB "
          f"(sharded {r.sharded_bytes_per_rank / gib:.2f}, replicated {r.replicated_bytes_per_rank / gib:.2f}; "
          f"whole model {r.weight_bytes_total / gib:.1f} GiB)")
    print(f"  cache per token    {r.cache_bytes_per_token} B; KDA state per sequence "
          f"{r.kda_state_bytes_per_seq / 2**20:.1f} MiB per rank")
    print(f"  cache tokens       {r.cache_tokens}")
    print(f"  {r.reason}")
    return 0 if r.fits else 1
