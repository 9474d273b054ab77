"""Train the default model's MTP (NextN) layer with the target frozen, and write it into the checkpoint.

Owns: the distillation loop over a draft's chained steps, its held-out report, and the checkpoint side: reading an
existing MTP layer as the starting point, writing the layer in the release names as layer ``num_hidden_layers``
beside the target's unchanged tensors. The block and its unrolled forward are ``mtp_block.py``'s; the data and the
target's training are ``data.py``'s and ``train_model.py``'s.

The block's input is what ``flashinfra.model.mtp`` defines: ``eh_proj(enorm(embed(next token)) ‖ hnorm(hidden))``,
the hidden being the target's at step 1 (the mean over the mHC streams after the final norm, i.e. transformers'
``last_hidden_state``) and the block's own output before ``shared_head.norm`` at each chained step, as the engine
feeds it. ``--chain N`` unrolls N draft positions (``MTPTrainBlock.chain``): step ``s`` at base ``i`` reads the
token at ``i + s`` and is trained to match the target's distribution at ``i + s`` (soft cross-entropy: a draft is
accepted when it equals the target's choice), weighted ``--chain-decay ** (s - 1)``, since draft ``s`` is only
verified once drafts ``1..s-1`` were accepted.

The chained tokens are the data's (teacher forcing, as DeepSeek-V3's MTP and EAGLE train), not the target's argmax:
the label at ``i + s`` is the target's distribution after the data's tokens up to ``i + s``, so the token fed must
be the data's too for input and label to share one context. In the engine a chained step is fed a draft, which
counts only when it equals the target's greedy choice; training on text the target generated itself would close
that gap. By default training starts from the checkpoint's own MTP layer when it has one (``--mtp-from``: another
checkpoint's, of the same configuration; ``--fresh``: from the target's last attention layer).

Reported on held-out text, before and after: per chained position the block's top-1 agreement with the target's
argmax (teacher-forced acceptance of draft ``s``); the share of bases whose drafts ``1..s`` all agree (what
``bench/speculative.py`` reports as the acceptance at position ``s``, accepted / drafted there, though here on the
data's text where the engine drafts on the target's own continuations) and its sum, the drafts accepted per step;
the block's loss against the data's token; the target's loss (unchanged: its tensors are copied byte for byte).

    python train/train_mtp.py --model flashinfra/assets/default-model --data .gpu/train --out /tmp/mtp \\
        --device cuda --budget-s 140 --batch 64 --chain 3
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
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from mtp_block import MTPTrainBlock
from train_model import RouterBalance, batches, lr_at, pack

MTP_CONTEXT = 256  # training window (tokens per row)
# the block's own tensors: attribute -> release name under layers.N.
OWN_TENSORS = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
               "input_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
               "head_norm": "shared_head.norm.weight"}


@torch.no_grad()
def target_pass(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token windows [B, L + 1] -> the target's final hidden [B, L + 1, D] and its logits [B, L + 1, V]."""
    h = target.model(input_ids=x).last_hidden_state
    return h, target.lm_head(h).float()


def chain_logits(target, block: MTPTrainBlock, x: torch.Tensor, h: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per chained step ``s`` the block's logits [B, L - s + 1, V] at bases ``0..L - s`` (predicting ``i + s + 1``)."""
    outs = block.chain(target.model.language_model.embed_tokens, x, h, steps)
    return [target.lm_head(block.head_norm(o)).float() for o in outs]


def chain_weights(steps: int, decay: float) -> list[float]:
    return [decay**s for s in range(steps)]


def distill_loss(logits: list[torch.Tensor], target_logits: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Soft cross-entropy of each step against the target's distribution at ``i + s``, weighted, normalised by the
    weights' sum (one step: the plain loss)."""
    total = 0.0
    for s, (lg, w) in enumerate(zip(logits, weights), start=1):
        want = F.softmax(target_logits[:, s : s + lg.shape[1]], -1)
        total = total + w * -(want * F.log_softmax(lg, -1)).sum(-1).mean()
    return total / sum(weights)


@torch.no_grad()
def heldout_metrics(target, block, stream: np.ndarray, batch: int, n_batches: int, steps: int) -> dict:
    """On the bases whose every chained step has its data token in the window (``0..L - steps - 1``)."""
    block.eval()
    L = MTP_CONTEXT
    windows = [stream[i : i + L + 1] for i in range(0, len(stream) - L - 1, L)][: batch * n_batches]
    n = L - steps
    mtp_loss, agree, prefix = np.zeros(steps), np.zeros(steps), np.zeros(steps)
    target_loss, n_mtp, n_target = 0.0, 0, 0
    for b in range(0, len(windows), batch):
        x = torch.from_numpy(np.stack(windows[b : b + batch]).astype(np.int64)).to(block.eh_proj.weight.device)
        h, tl = target_pass(target, x)
        all_agree = torch.ones(x.shape[0], n, dtype=torch.bool, device=x.device)
        for s, lg in enumerate(chain_logits(target, block, x, h, steps), start=1):
            lg = lg[:, :n]
            data_next = x[:, s + 1 : s + 1 + n].flatten()
            mtp_loss[s - 1] += F.cross_entropy(lg.flatten(0, 1), data_next, reduction="sum").item()
            hit = lg.argmax(-1) == tl[:, s : s + n].argmax(-1)
            all_agree &= hit
            agree[s - 1] += hit.sum().item()
            prefix[s - 1] += all_agree.sum().item()
        n_mtp += x.shape[0] * n
        target_loss += F.cross_entropy(tl[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n_target += x.shape[0] * L
    block.train()

    def per_step(v):
        return [round(float(a) / n_mtp, 4) for a in v]

    return {"heldout_mtp_loss": round(mtp_loss[0] / n_mtp, 4), "heldout_target_loss": round(target_loss / n_target, 4),
            "heldout_first_draft_agreement": per_step(agree)[0], "heldout_chain_agreement": per_step(agree),
            "heldout_chain_all_agree": per_step(prefix), "heldout_accepted_per_step": round(prefix.sum() / n_mtp, 4),
            "heldout_chain_loss": per_step(mtp_loss), "heldout_positions": n_mtp}


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
    own = {dst + name: getattr(block, attr).weight for attr, name in OWN_TENSORS.items()}
    out.update({k: v.detach().cpu().to(torch.bfloat16).contiguous() for k, v in own.items()})
    return out


def read_mtp_layer(model_dir: Path, target, block: MTPTrainBlock) -> bool:
    """Load the checkpoint's own MTP layer into ``block`` (the inverse of ``mtp_tensors``: the attention and MoE
    through transformers' own loading, from a copy of the target's files with the layer in the template's place).
    False, and ``block`` untouched, when the checkpoint has none."""
    N, t = target.model.language_model.config.num_hidden_layers, block.template
    weights = load_file(str(model_dir / "model.safetensors"))
    src, dst = f"model.language_model.layers.{N}.", f"model.language_model.layers.{t}."
    layer = {k[len(src):]: v for k, v in weights.items() if k.startswith(src)}
    if not layer:
        return False
    modules = (dst + "self_attn.", dst + "mlp.")
    swapped = {k: v for k, v in weights.items() if not k.startswith(src) and not k.startswith(modules)}
    swapped.update({dst + k: v for k, v in layer.items() if k.startswith(("self_attn.", "mlp."))})
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("config.json", "generation_config.json"):
            if (model_dir / f).exists():
                shutil.copy(model_dir / f, Path(tmp) / f)
        save_file(swapped, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        loaded = type(target).from_pretrained(tmp, dtype=torch.float32).model.language_model.layers[t]
    device = block.eh_proj.weight.device
    with torch.no_grad():
        block.self_attn.load_state_dict(loaded.self_attn.state_dict())
        block.mlp.load_state_dict(loaded.mlp.state_dict())
        for attr, name in OWN_TENSORS.items():
            getattr(block, attr).weight.copy_(layer[name].to(device, torch.float32))
    return True


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
    resumed = not args.fresh and read_mtp_layer(args.mtp_from or args.model, target, block)
    weights = chain_weights(args.chain, args.chain_decay)
    params = [p for p in block.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    balance = RouterBalance(block, args.bias_rate)
    data = batches(train_ids, args.batch, MTP_CONTEXT, np.random.default_rng(args.seed))
    before = heldout_metrics(target, block, heldout_ids, args.batch, args.eval_batches, args.chain)
    print(json.dumps({"step": 0, **before}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = open(args.out.with_suffix(".log.jsonl"), "w")
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < args.budget_s and (args.max_steps is None or step < args.max_steps):
        x = next(data).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, (time.perf_counter() - start) / args.budget_s, args.lr, args.warmup)
        h, tl = target_pass(target, x)
        loss = distill_loss(chain_logits(target, block, x, h, args.chain), tl, weights)
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
    log.close()
    train_s = time.perf_counter() - start
    after = heldout_metrics(target, block, heldout_ids, args.batch, args.eval_batches, args.chain)
    N = target.model.language_model.config.num_hidden_layers
    write_checkpoint(args.model, args.out, mtp_tensors(target, block), f"model.language_model.layers.{N}.")
    summary = {"steps": step, "train_s": round(train_s, 1), "tokens_seen": step * args.batch * MTP_CONTEXT,
               "started_from": (f"the MTP layer of {args.mtp_from or args.model}" if resumed
                                else "the target's last attention layer"),
               "chain_weights": weights, "before": before, "after": after,
               "checkpoint_bytes": (args.out / "model.safetensors").stat().st_size,
               "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "mtp-train-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("flashinfra/assets/default-model"), help="the target")
    p.add_argument("--data", type=Path, default=Path(".gpu/data"), help="data.py's output")
    p.add_argument("--out", type=Path, default=Path(".gpu/model-mtp"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=840.0, help="wall-clock training time")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (within the budget)")
    p.add_argument("--chain", type=int, default=3, help="draft positions unrolled per base (1: the first draft only)")
    p.add_argument("--chain-decay", type=float, default=0.8, help="loss weight of draft s: decay ** (s - 1)")
    p.add_argument("--fresh", action="store_true",
                   help="start from the target's last attention layer even when the checkpoint has an MTP layer")
    p.add_argument("--mtp-from", type=Path, default=None,
                   help="the checkpoint whose MTP layer training starts from (default --model; e.g. the shipped "
                        "model's, for a target retrained without one)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--log-every", type=int, default=5)
    return p.parse_args(argv)


def main() -> None:
    print(json.dumps(train(parse_args()), indent=2))


if __name__ == "__main__":
    main()
