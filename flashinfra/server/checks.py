"""Checks and benchmarks of the server's text path, registered with ``flashinfra.feedback.registry``.

``server.detokenizer``: incremental detokenization of random token sequences (partial UTF-8 bytes
included) fed in random chunk sizes equals one full decode; stop strings cut the text exactly at their
first occurrence. ``server.detokenize``: the server's CPU time per streamed token (detokenize + stop
check), which every streamed token pays on the server's event loop.
"""

from __future__ import annotations

import random

from flashinfra.feedback.registry import BenchContext, BenchSpec, CheckResult, register_benchmark, register_check


def _tokenizer():
    from flashinfra.model.factory import default_model_dir
    from flashinfra.server.tokenizer import Tokenizer

    return Tokenizer(default_model_dir())


def _stream(tok, ids: list[int], stop: tuple[str, ...], rng: random.Random) -> str:
    from flashinfra.server.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tok, [], stop)
    out = []
    i = 0
    while i < len(ids) and not detok.stopped:
        size = rng.randint(1, 4)
        for t in ids[i:i + size]:
            detok.add_token(t)
        i += size
        out.append(detok.pop_delta())
    detok.finish()
    out.append(detok.pop_delta(final=True))
    return "".join(out)


@register_check("server.detokenizer", tags=("server",))
def check_detokenizer() -> list[CheckResult]:
    tok = _tokenizer()
    rng = random.Random(0)
    cases = 200
    wrong_text, wrong_stop = [], []
    for case in range(cases):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 64))]
        full = tok.decode(ids)
        if _stream(tok, ids, (), random.Random(case)) != full:
            wrong_text.append(case)
        if len(full) >= 4:
            start = rng.randrange(len(full) - 2)
            stop = full[start:start + rng.randint(1, 3)]
            if _stream(tok, ids, (stop,), random.Random(case)) != full[:full.find(stop)]:
                wrong_stop.append(case)
    return [
        CheckResult("server.detokenizer.stream", passed=not wrong_text, num_bad=len(wrong_text),
                    message=f"{len(wrong_text)}/{cases} streamed texts differ from the full decode"
                            + (f" (cases {wrong_text[:8]})" if wrong_text else "")),
        CheckResult("server.detokenizer.stop", passed=not wrong_stop, num_bad=len(wrong_stop),
                    message=f"{len(wrong_stop)} stop-string cuts misplaced"
                            + (f" (cases {wrong_stop[:8]})" if wrong_stop else "")),
    ]


@register_benchmark("server.detokenize", tags=("server", "cpu"))
def bench_detokenize(ctx: BenchContext) -> BenchSpec:
    tok = _tokenizer()
    num_tokens = 64 if ctx.quick else 512

    def make_inputs(seed: int):
        rng = random.Random(seed)
        return ([rng.randrange(tok.vocab_size) for _ in range(num_tokens)],)

    def run(ids: list[int]) -> str:
        from flashinfra.server.detokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(tok, [], ("\n\n\n\n",))
        for t in ids:
            detok.add_token(t)
            detok.pop_delta()
        detok.finish()
        return detok.text

    return BenchSpec(fn=run, make_inputs=make_inputs, description=f"detokenize + stop check, {num_tokens} tokens "
                     "one at a time (divide by the token count for the per-token cost)",
                     params={"num_tokens": num_tokens})
