"""Train the default model: a small GLM-5.3-Flash-architecture checkpoint, with transformers' own classes.

Owns: the model's configuration (every layer kind of the release: KDA, MLA with the DSA indexer and
k-pool 4, a dense first MLP then MoE, mHC with 4 streams), packing the tokenized text into one stream,
the training loop (fixed seed, bf16 autocast, AdamW, warmup + cosine, DeepSeek-style bias balancing of
the MoE router) and writing a standard checkpoint with ``save_pretrained`` plus the tokenizer files.

The model is ``Glm5NextForConditionalGeneration`` with a one-block vision tower (the class always has
one; text never reaches it). KDA runs through ``kda_chunk.py`` by default (``--kda torch``: the same
computation as transformers' PyTorch path, without its row loop, no compile step); ``--kda fla`` leaves
transformers on fla-core's Triton kernels, which compile and autotune for minutes on a first call.
The whole script is checked on a CPU with ``--tiny --steps 3 --batch 2``.

    python train/train_model.py --data .gpu/data --tokenizer .gpu/tokenizer --out .gpu/model \
        --budget-s 270 --batch 128 --lr 4e-3 --warmup 15   # cosine over the wall-clock budget
    python train/train_model.py ... --steps 480            # or over an exact number of steps
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

CONTEXT = 512  # training window; index_topk below is a quarter of it, so the indexer's choice matters
CHAT_EVERY = 4  # every 4th document is wrapped as a one-turn chat (title -> body) to teach the template


def text_config(special: dict[str, int], tiny: bool = False) -> dict:
    hidden = 64 if tiny else 256
    return {
        "model_type": "glm5_next_text",
        "vocab_size": max(special.values()) + 1,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": 3 * hidden // 16,
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention"] * 3 + ["indexed_attention"] + ["linear_attention"] * 3
        + ["indexed_attention"],
        "mlp_layer_types": ["dense"] + ["sparse"] * 7,
        "indexer_types": ["full"] * 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": hidden // 4,
        "qk_nope_head_dim": hidden // 4,
        "v_head_dim": hidden // 4,
        "qk_rope_head_dim": 0,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": CONTEXT // 4,
        "index_kpool": 4,
        "linear_num_heads": 2,
        "linear_head_dim": hidden // 4,
        "linear_conv_kernel_dim": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "pad_token_id": special["<|endoftext|>"],
        "eos_token_id": [special[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")],
    }


def model_config(special: dict[str, int], tiny: bool = False):
    from transformers import Glm5NextConfig

    text = text_config(special, tiny)
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": text["hidden_size"],
        "projection_intermediate_size": 64,
    }
    return Glm5NextConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=special["<|image|>"],
        video_token_id=special["<|video|>"],
        image_start_token_id=special["<|begin_of_image|>"],
        image_end_token_id=special["<|end_of_image|>"],
        video_start_token_id=special["<|begin_of_video|>"],
        video_end_token_id=special["<|end_of_video|>"],
        tie_word_embeddings=False,
    )


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def document_ids(tok: Tokenizer, special: dict[str, int], index: int, text: str) -> list[int]:
    """A plain document ends with <|endoftext|>; a chat one is a GLM turn ending where <|user|> would follow."""
    if index % CHAT_EVERY == CHAT_EVERY - 1 and "\n" in text:
        title, body = text.split("\n", 1)
        head = [special["[gMASK]"], special["<sop>"], special["<|user|>"]] + tok.encode("\n" + title).ids
        return head + [special["<|assistant|>"]] + tok.encode("\n" + body.strip()).ids + [special["<|user|>"]]
    return tok.encode(text).ids + [special["<|endoftext|>"]]


def pack(data: Path, tok: Tokenizer, split: str, seed: int) -> np.ndarray:
    """All documents of a split, shuffled with ``seed``, as one token stream (cached beside the data)."""
    cache = data / f"{split}-ids-{seed}.npy"
    if cache.exists():
        return np.load(cache)
    rows = [json.loads(line)["text"] for line in open(data / f"{split}.jsonl", encoding="utf-8")]
    order = np.random.default_rng(seed).permutation(len(rows))
    special = special_ids(tok)
    ids: list[int] = []
    for i in order:
        ids += document_ids(tok, special, int(i), rows[i])
    stream = np.asarray(ids, dtype=np.uint16 if max(ids) < 2**16 else np.int32)
    np.save(cache, stream)
    return stream


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine to a tenth of ``peak`` as ``progress`` goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class RouterBalance:
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step, nudge each router's
    ``e_score_correction_bias`` up for under-used experts and down for over-used ones."""

    def __init__(self, model: torch.nn.Module, rate: float):
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, Glm5NextTextTopkRouter)]
        self.counts = {id(r): torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._count)

    def _count(self, router, _inputs, outputs) -> None:
        topk_indices = outputs[2]
        self.counts[id(router)] += torch.bincount(topk_indices.flatten(), minlength=router.num_experts)

    @torch.no_grad()
    def update(self) -> float:
        worst = 0.0
        for r in self.routers:
            load = self.counts[id(r)]
            r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, float(load.max() / load.mean().clamp_min(1)))
            load.zero_()
        return worst


def batches(stream: np.ndarray, batch: int, context: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - context - 1, size=batch)
        yield torch.from_numpy(np.stack([stream[s : s + context + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def heldout_loss(model, stream: np.ndarray, context: int, batch: int, device, n_batches: int = 4) -> float:
    model.eval()
    losses = []
    windows = [stream[i : i + context + 1] for i in range(0, len(stream) - context - 1, context)]
    for b in range(n_batches):
        chunk = windows[b * batch : (b + 1) * batch]
        if not chunk:
            break
        x = torch.from_numpy(np.stack(chunk).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return float(np.mean(losses))


def train(args) -> dict:
    from transformers import Glm5NextForConditionalGeneration, GenerationConfig
    from transformers.models.glm5_next import modeling_glm5_next

    if args.kda == "torch":
        from kda_chunk import chunk_kda

        modeling_glm5_next.chunk_kimi_delta_attention = chunk_kda

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("high")
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    special = special_ids(tok)
    train_ids = pack(args.data, tok, "train", args.seed)
    heldout_ids = pack(args.data, tok, "heldout", args.seed)
    cfg = model_config(special, tiny=args.tiny)
    if args.init:
        # Continue from an earlier checkpoint of this same configuration (weights upcast to float32).
        model = Glm5NextForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32).to(device)
    else:
        model = Glm5NextForConditionalGeneration(cfg).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_text = sum(p.numel() for n, p in model.named_parameters() if "visual" not in n)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    balance = RouterBalance(model, args.bias_rate)
    data = batches(train_ids, args.batch, CONTEXT, np.random.default_rng(args.seed))

    log = open(args.out / "train-log.jsonl", "w")
    start = time.perf_counter()
    step = 0
    while (step < args.steps) if args.steps else (time.perf_counter() - start < args.budget_s):
        x = next(data).to(device, non_blocking=True)
        # With --steps the schedule runs over steps; otherwise over the wall-clock budget.
        progress = step / args.steps if args.steps else (time.perf_counter() - start) / args.budget_s
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balance.update()
        step += 1
        last = (step == args.steps) if args.steps else (time.perf_counter() - start >= args.budget_s)
        if step % args.log_every == 0 or last:
            row = {
                "step": step,
                "loss": round(loss.item(), 4),
                "lr": opt.param_groups[0]["lr"],
                "grad_norm": round(float(grad_norm), 3),
                "expert_imbalance": round(imbalance, 3),
                "elapsed_s": round(time.perf_counter() - start, 1),
            }
            if step % (args.log_every * 10) == 0 or last:
                row["heldout_loss"] = round(heldout_loss(model, heldout_ids, CONTEXT, args.batch, device), 4)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - start

    model = model.to(torch.bfloat16)
    model.save_pretrained(args.out)
    GenerationConfig(
        eos_token_id=cfg.text_config.eos_token_id, pad_token_id=cfg.text_config.pad_token_id, do_sample=False
    ).save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.tokenizer / name, args.out / name)
    summary = {
        "steps": step,
        "train_s": round(train_s, 1),
        "tokens_seen": step * args.batch * CONTEXT,
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(heldout_ids)),
        "params": n_params,
        "text_params": n_text,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "final_heldout_loss_bf16": heldout_loss(model.float(), heldout_ids, CONTEXT, args.batch, device),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "train-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=Path(".gpu/data"))
    p.add_argument("--tokenizer", type=Path, default=Path(".gpu/tokenizer"))
    p.add_argument("--out", type=Path, default=Path(".gpu/model"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="exact number of steps (0: fit --budget-s)")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--kda", choices=("torch", "fla"), default="torch", help="KDA implementation (see kda_chunk.py)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--init", type=Path, default=None, help="checkpoint to continue from")
    p.add_argument("--tiny", action="store_true", help="hidden 64: a quick CPU check of the whole script")
    p.add_argument("--pack-only", action="store_true", help="write the token streams beside --data and stop")
    args = p.parse_args()
    if args.pack_only:
        tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
        print({split: len(pack(args.data, tok, split, args.seed)) for split in ("train", "heldout")})
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(train(args), indent=2))


if __name__ == "__main__":
    main()
