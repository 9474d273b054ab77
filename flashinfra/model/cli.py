"""``flashinfra generate``: generate text from a prompt with the offline ``LLM`` (built-in default model
unless ``--model`` is given); greedy unless ``--temperature`` is above 0."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", nargs="+", help="prompt text (several words are joined with spaces)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in default model)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when available)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for the prompt (repeatable; placed at <|image|> marks, else before the text)")
    p.add_argument("--video", action="append", default=[], metavar="FILE", help="a video file (repeatable; needs av)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashinfra.engine.sched.messages import SamplingParams
    from flashinfra.llm import LLM

    prompt = " ".join(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        media = bool(args.image or args.video)
        llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=1, enable_vision=media)
        out = llm.generate(prompt, params, images=[args.image] if media else None,
                           videos=[args.video] if media else None)[0]
    except ValueError as e:
        raise SystemExit(f"generate: {e}") from None
    if out.finish_reason == "error":
        raise SystemExit(f"generate: {out.error}")
    print(prompt + (out.text or ""))
    return 0
