"""``flashinfra eval perplexity --model DIR FILE``: perplexity of a checkpoint on a text file.

The file is read as UTF-8, tokenized whole with the checkpoint's ``tokenizer.json`` (no special tokens
added) and scored through ``flashinfra.load_model`` by ``perplexity.py``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

from flashinfra.engine.config import LoadConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="accuracy measurements (perplexity)")
    sub = p.add_subparsers(dest="eval_command", required=True)
    ppl = sub.add_parser("perplexity", help="perplexity of a model on a text file, through the engine")
    ppl.add_argument("file", help="UTF-8 text file")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (context + scored)")
    ppl.add_argument("--stride", type=int, default=None, help="tokens between window starts (default window - 1)")
    ppl.add_argument("--max-batch-tokens", type=int, default=4096, help="tokens per packed forward")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the file")
    ppl.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="a progress bar on stderr (default: when stderr is a terminal)")
    LoadConfig.add_args(ppl.add_argument_group("model"))
    ppl.set_defaults(func=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tokenizers import Tokenizer

    import flashinfra
    from flashinfra.eval.perplexity import perplexity
    from flashinfra.model.factory import default_model_dir

    try:
        config = LoadConfig.from_args(args).resolved()
    except ValueError as e:
        raise SystemExit(f"eval perplexity: {e}") from None
    model_dir = Path(config.model) if config.model else default_model_dir()
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise SystemExit(f"eval perplexity: {tokenizer_file} not found (the checkpoint needs its tokenizer)")
    text_file = Path(args.file)
    if not text_file.is_file():
        raise SystemExit(f"eval perplexity: no such file: {text_file}")
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SystemExit(f"eval perplexity: {text_file} is not UTF-8 text ({e})") from None
    ids = Tokenizer.from_file(str(tokenizer_file)).encode(text, add_special_tokens=False).ids
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if len(ids) < 2:
        raise SystemExit(f"eval perplexity: {text_file} holds {len(ids)} token(s); at least 2 are needed")
    from flashinfra.quant.cache import CacheSpec

    model = flashinfra.load_model(model_dir, dtype=config.dtype, device=config.device,
                                  quantization=config.quantization, cache_spec=CacheSpec.of(config))
    try:
        result = perplexity(model, ids, args.window, args.stride, args.max_batch_tokens,
                            progress=args.progress)
    except ValueError as e:
        raise SystemExit(f"eval perplexity: {e}") from None
    out = {"model": str(model_dir), "file": str(text_file), "dtype": config.dtype, "device": config.device}
    print(json.dumps({**out, **result.as_dict()}, indent=2))
    return 0
