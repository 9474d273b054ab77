"""``flashinfra quantize --w8a8 SRC DST``: write a W8A8 checkpoint (``flashinfra.quant.checkpoint``)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write an 8-bit checkpoint that loads directly")
    p.add_argument("--w8a8", action="store_true", required=True,
                   help="int8 weights per output channel (activations int8 per token at run time)")
    p.add_argument("src", help="source checkpoint directory (float weights)")
    p.add_argument("dst", help="destination directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashinfra.model.loader import CheckpointError
    from flashinfra.quant.checkpoint import quantize_checkpoint

    try:
        out = quantize_checkpoint(args.src, args.dst)
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"quantize: {e}") from None
    print(out)
    return 0
