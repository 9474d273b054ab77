"""Train the default model's MTP (NextN) layer with the target frozen, and write it into the checkpoint.

Owns: the MTP block as a trainable module (transformers' own MLA/DSA attention and MoE modules, initialised
from the target's last attention layer, plus ``enorm``, ``hnorm``, ``eh_proj`` and the norms; no mHC), its
input as ``flashinfra.model.mtp`` defines it (``eh_proj(enorm(embed(next token)) ‖ hnorm(target hidden))``,
the target hidden being the mean over the mHC streams after the final norm, i.e. transformers'
``last_hidden_state``), the distillation loop, and writing the layer in the release names as layer
``num_hidden_layers`` beside the target's unchanged tensors. Leaves the data and the target's training to
``data.py`` and ``train_model.py``.

The block at position ``i`` reads the target hidden at ``i`` and the token at ``i + 1``; it is trained to match
the target's next-token distribution at ``i + 1`` (soft cross-entropy), since a draft is accepted when it equals
the target's choice. Reported on held-out text: the block's loss against the data's token, its top-1 agreement
with the target's argmax at ``i + 1`` (the first draft's teacher-forced acceptance), and the target's loss
(unchanged: its tensors are copied byte for byte).

    nice -n 19 python train/train_mtp.py --model flashinfra/assets/default-model --data .gpu/data \\
        --out .gpu/model-mtp --budget-s 840
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from train_model import RouterBalance, batches, lr_at, pack

MTP_CONTEXT = 256  # training window; the indexer keeps every key at this length (index_topk x k-pool >= 256)


class MTPTrainBlock(nn.Module):
    def __init__(self, target):
        super().__init__()
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

        lm = target.model.language_model
        cfg = lm.config
        D, last = cfg.hidden_size, cfg.num_hidden_layers - 1

        def norm(init=None):
            n = Glm5NextTextRMSNorm(D, cfg.rms_norm_eps)
            if init is not None:
                n.weight.data.copy_(init)
            return n

        self.enorm, self.hnorm, self.input_norm, self.post_attn_norm = norm(), norm(), norm(), norm()
        self.head_norm = norm(lm.norm.weight.data)  # the target's head reads hiddens of its final norm's scale
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=cfg.initializer_range)
        source = lm.layers[last]  # the last attention layer: an indexed MLA layer with an MoE
        self.self_attn, self.mlp = copy.deepcopy(source.self_attn), copy.deepcopy(source.mlp)
        self.template = last

    def forward(self, next_embeds: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, L, D] each -> the block's output hidden [B, L, D] (before ``head_norm``)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(target_hidden)], dim=-1))
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        x = x + self.self_attn(hidden_states=self.input_norm(x), attention_mask=mask)[0]
        return x + self.mlp(self.post_attn_norm(x))


@torch.no_grad()
def target_pass(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token windows [B, L + 1] -> the target's final hidden [B, L + 1, D] and its logits [B, L + 1, V]."""
    h = target.model(input_ids=x).last_hidden_state
    return h, target.lm_head(h).float()


def mtp_logits(target, block: MTPTrainBlock, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The block's logits [B, L, V] at positions 0..L-1 (predicting the token at i + 2)."""
    embed = target.model.language_model.embed_tokens
    out = block(embed(x[:, 1:]), h[:, :-1])
    return target.lm_head(block.head_norm(out)).float()


def distill_loss(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy against the target's distribution at the next position."""
    return -(F.softmax(target_logits[:, 1:], -1) * F.log_softmax(logits, -1)).sum(-1).mean()


@torch.no_grad()
def heldout_metrics(target, block, stream: np.ndarray, batch: int, n_batches: int) -> dict:
    block.eval()
    L = MTP_CONTEXT
    windows = [stream[i : i + L + 1] for i in range(0, len(stream) - L - 1, L)][: batch * n_batches]
    mtp_loss = target_loss = agree = 0.0
    n_mtp = n_target = 0
    for b in range(0, len(windows), batch):
        x = torch.from_numpy(np.stack(windows[b : b + batch]).astype(np.int64)).to(block.eh_proj.weight.device)
        h, tl = target_pass(target, x)
        ml = mtp_logits(target, block, x, h)[:, :-1]  # positions whose token i + 2 is in the window
        mtp_loss += F.cross_entropy(ml.flatten(0, 1), x[:, 2:].flatten(), reduction="sum").item()
        agree += (ml.argmax(-1) == tl[:, 1:-1].argmax(-1)).sum().item()
        n_mtp += ml.shape[0] * ml.shape[1]
        target_loss += F.cross_entropy(tl[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n_target += x.shape[0] * L
    block.train()
    return {"heldout_mtp_loss": round(mtp_loss / n_mtp, 4), "heldout_target_loss": round(target_loss / n_target, 4),
            "heldout_first_draft_agreement": round(agree / n_mtp, 4), "heldout_positions": n_mtp}


def mtp_tensors(target, block: MTPTrainBlock) -> dict[str, torch.Tensor]:
    """The block's tensors in the release names of layer ``num_hidden_layers``: the attention and MoE through
    transformers' own saving (a copy of the target with the trained modules in the template layer's place)."""
    lm = target.model.language_model
    N, t = lm.config.num_hidden_layers, block.template
    model = copy.deepcopy(target).cpu()
    model.model.language_model.layers[t].self_attn = copy.deepcopy(block.self_attn).cpu()
    model.model.language_model.layers[t].mlp = copy.deepcopy(block.mlp).cpu()
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
    src, dst = f"model.language_model.layers.{t}.", f"model.language_model.layers.{N}."
    out = {dst + k[len(src):]: v for k, v in saved.items()
           if k.startswith(src + "self_attn.") or k.startswith(src + "mlp.")}
    own = {"enorm.weight": block.enorm.weight, "hnorm.weight": block.hnorm.weight, "eh_proj.weight": block.eh_proj.weight,
           "input_layernorm.weight": block.input_norm.weight,
           "post_attention_layernorm.weight": block.post_attn_norm.weight,
           "shared_head.norm.weight": block.head_norm.weight}
    out.update({dst + k: v.detach().cpu().to(torch.bfloat16).contiguous() for k, v in own.items()})
    return out


def write_checkpoint(model_dir: Path, out: Path, tensors: dict[str, torch.Tensor], mtp_prefix: str) -> None:
    """The target's files with the MTP layer (every tensor under ``mtp_prefix``) added, or replaced where the
    target already has one (retraining); the target's own tensors as they were."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    weights = {k: v for k, v in load_file(str(model_dir / "model.safetensors")).items()
               if not k.startswith(mtp_prefix)}
    save_file({**weights, **tensors}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def train(args) -> dict:
    from transformers import Glm5NextForConditionalGeneration
    from transformers.models.glm5_next import modeling_glm5_next
    from kda_chunk import chunk_kda

    modeling_glm5_next.chunk_kimi_delta_attention = chunk_kda
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    train_ids, heldout_ids = (pack(args.data, tok, split, args.seed) for split in ("train", "heldout"))
    device = torch.device(args.device)
    target = Glm5NextForConditionalGeneration.from_pretrained(args.model, dtype=torch.float32).to(device)
    target.eval().requires_grad_(False)
    block = MTPTrainBlock(target).to(device).train()
    params = [p for p in block.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    balance = RouterBalance(block, args.bias_rate)
    data = batches(train_ids, args.batch, MTP_CONTEXT, np.random.default_rng(args.seed))
    before = heldout_metrics(target, block, heldout_ids, args.batch, args.eval_batches)
    print(json.dumps({"step": 0, **before}), flush=True)
    log = open(args.out.with_suffix(".log.jsonl"), "w")
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < args.budget_s:
        x = next(data).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, (time.perf_counter() - start) / args.budget_s, args.lr, args.warmup)
        h, tl = target_pass(target, x)
        loss = distill_loss(mtp_logits(target, block, x, h), tl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balance.update()
        step += 1
        if step % args.log_every == 0:
            row = {"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(time.perf_counter() - start, 1)}
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
    train_s = time.perf_counter() - start
    after = heldout_metrics(target, block, heldout_ids, args.batch, args.eval_batches)
    N = target.model.language_model.config.num_hidden_layers
    write_checkpoint(args.model, args.out, mtp_tensors(target, block), f"model.language_model.layers.{N}.")
    summary = {"steps": step, "train_s": round(train_s, 1), "tokens_seen": step * args.batch * MTP_CONTEXT,
               "before": before, "after": after, "checkpoint_bytes": (args.out / "model.safetensors").stat().st_size,
               "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "mtp-train-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("flashinfra/assets/default-model"), help="the target")
    p.add_argument("--data", type=Path, default=Path(".gpu/data"), help="data.py's output")
    p.add_argument("--out", type=Path, default=Path(".gpu/model-mtp"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=840.0, help="wall-clock training time")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()
    print(json.dumps(train(args), indent=2))


if __name__ == "__main__":
    main()
