"""``flashinfra generate``: greedy generation from a prompt, on the built-in default model by default."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt (greedy)")
    p.add_argument("prompt", nargs="+", help="prompt text")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in default model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from tokenizers import Tokenizer

    import flashinfra
    from flashinfra.model.factory import default_model_dir
    from flashinfra.model.forward_batch import ForwardBatch

    path = args.model or default_model_dir()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = flashinfra.load_model(path, dtype=args.dtype, device=device)
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    ids = tok.encode(" ".join(args.prompt)).ids
    if not ids:
        raise SystemExit("generate: the prompt encodes to no tokens")
    block = 16
    total = len(ids) + args.max_tokens
    table = list(range((total + block - 1) // block))
    cache = model.allocate_cache(len(table), block, 1)
    eos = set(model.config.text.eos_token_id)
    out: list[int] = []
    pending, context = ids, 0
    for _ in range(args.max_tokens):
        batch = ForwardBatch.build([len(pending)], [context], [0], [table], block, device)
        hidden = model.forward(torch.tensor(pending, device=device), batch, cache)
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        context += len(pending)
        if token in eos:
            break
        out.append(token)
        pending = [token]
    print(tok.decode(ids + out))
    return 0
