"""``flashinfra quantize --w8a8|--fp8 SRC DST``: write an 8-bit checkpoint (``flashinfra.quant.checkpoint``)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write an 8-bit checkpoint that loads directly")
    scheme = p.add_mutually_exclusive_group(required=True)
    scheme.add_argument("--w8a8", action="store_true",
                        help="int8 weights per output channel (activations int8 per token at run time)")
    scheme.add_argument("--fp8", action="store_true",
                        help="e4m3 weights per 128x128 block with weight_scale_inv, the released format")
    p.add_argument("src", help="source checkpoint directory (float weights)")
    p.add_argument("dst", help="destination directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashinfra.model.loader import CheckpointError
    from flashinfra.quant.checkpoint import quantize_checkpoint

    try:
        out = quantize_checkpoint(args.src, args.dst, "fp8" if args.fp8 else "w8a8")
    except (ValueError, CheckpointError, FileNotFoundError) as e:
        raise SystemExit(f"quantize: {e}") from None
    print(out)
    return 0
