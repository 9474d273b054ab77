"""``flashinfra generate``: generate text from a prompt with the offline ``LLM`` (built-in default model
unless ``--model`` is given). Sampling flags left out take the checkpoint's ``generation_config.json``
defaults (the built-in model's: greedy with a repetition penalty of 1.3, 64 tokens).

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
    from_ckpt = "(default: the checkpoint's generation_config.json, else %s)"
    sampling.add_argument("--max-tokens", type=int, help="tokens to generate at most " + from_ckpt % 32)
    sampling.add_argument("--temperature", type=float, help="0 is greedy " + from_ckpt % 0)
    sampling.add_argument("--top-p", type=float, help="nucleus sampling mass " + from_ckpt % "1.0, off")
    sampling.add_argument("--top-k", type=int, help="sample among the k likeliest tokens " + from_ckpt % "0, off")
    sampling.add_argument("--repetition-penalty", type=float, help="above 1 discourages repeats " + from_ckpt % 1.0)
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop when the output contains TEXT (repeatable; default: none)")
    media = p.add_argument_group("media")
    media.add_argument("--image", action="append", default=[], metavar="FILE",
                       help="an image for the prompt (repeatable; placed at <|image|> marks, else before the text)")
    media.add_argument("--video", action="append", default=[], metavar="FILE",
                       help="a video file (repeatable; needs av)")
    EngineConfig.add_args(p.add_argument_group("engine"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from flashinfra.engine.sched.messages import SamplingParams
    from flashinfra.generation_defaults import apply_defaults
    from flashinfra.llm import LLM

    prompt = " ".join(args.prompt)
    try:
        media = bool(args.image or args.video)
        config = EngineConfig.from_args(args)
        if media:
            config = replace(config, enable_vision=True)
        llm = LLM(**asdict(config))
        given = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty")
                 if getattr(args, k) is not None}
        params = apply_defaults(SamplingParams(**{"max_tokens": 32, "temperature": 0.0, **given}),
                                llm.generation_defaults, set(given), include_max_tokens=True)
        out = llm.generate(prompt, params, images=[args.image] if media else None,
                           videos=[args.video] if media else None, stop=args.stop or None)[0]
    except ValueError as e:
        raise SystemExit(f"generate: {e}") from None
    if out.finish_reason == "error":
        raise SystemExit(f"generate: {out.error}")
    print(prompt + (out.text or ""))
    return 0
