"""``flashinfra generate``: generate text from a prompt with the offline ``LLM`` (built-in default model
unless ``--model`` is given); greedy unless ``--temperature`` is above 0.

The engine's flags (``--model``, ``--dtype``, ``--max-num-seqs``, ``--seed``...) are ``EngineConfig``'s, the
same as ``serve``'s; the sampling flags are this command's own.
"""

from __future__ import annotations

import argparse

from flashinfra.engine.config import EngineConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt")
    p.add_argument("prompt", nargs="+", help="prompt text (several words are joined with spaces)")
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default: 32)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    sampling.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0, off)")
    media = p.add_argument_group("media")
    media.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image for the prompt (repeatable; placed at <|image|> marks, else before the text)")
    media.add_argument("--video", action="append", default=[], metavar="FILE", help="a video file (repeatable; needs av)")
    EngineConfig.add_args(p.add_argument_group("engine"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from flashinfra.engine.sched.messages import SamplingParams
    from flashinfra.llm import LLM

    prompt = " ".join(args.prompt)
    try:
        media = bool(args.image or args.video)
        config = EngineConfig.from_args(args)
        if media:
            config = replace(config, enable_vision=True)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k)
        llm = LLM(**asdict(config))
        out = llm.generate(prompt, params, images=[args.image] if media else None,
                           videos=[args.video] if media else None)[0]
    except ValueError as e:
        raise SystemExit(f"generate: {e}") from None
    if out.finish_reason == "error":
        raise SystemExit(f"generate: {out.error}")
    print(prompt + (out.text or ""))
    return 0
