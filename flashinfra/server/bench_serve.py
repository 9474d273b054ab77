"""``flashinfra bench serve``: a load generator for any OpenAI-compatible endpoint.

Sends ``--num-prompts`` streamed requests, either keeping ``--concurrency`` in flight or arriving as a
Poisson process at ``--request-rate`` (both limits may apply), with random prompts of about
``--input-len`` tokens (whitespace-separated words; or exact token ids with ``--token-ids``) and
``--output-len`` output tokens. Measures per request the time to first token (TTFT), the time per output
token after the first (TPOT), the inter-token latencies of the stream (ITL) and the end-to-end latency,
and reports their mean and percentiles with request and token throughput, as JSON (printed, and written
to ``--output``). Token counts come from the server's ``usage`` (``stream_options.include_usage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

_WORDS = ("the of and to in is was for on that with as by at from his her an which are this be or had not "
          "but what all were when we there can more if no out so said up its about into than them only "
          "other new some could time these two may then first any like now my such make over our even most "
          "me state after also made many did must before back see through way where get much go well").split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def build_parser(prog: str = "flashinfra bench serve") -> argparse.ArgumentParser:
    from flashinfra.cli_help import DefaultsHelpFormatter, plain

    p = argparse.ArgumentParser(prog=prog, description=plain(__doc__.split("\n\n")[0]),
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="the API the requests go to")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: none)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in all")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: no bound)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second (Poisson); inf sends all at once (bounded by --concurrency)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens (about, for text)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly within +-ratio of --input-len/--output-len")
    p.add_argument("--token-ids", action="store_true",
                   help="send prompts as token ids (exact lengths; completions only)")
    p.add_argument("--vocab-size", type=int, default=400, help="token ids are drawn below this (--token-ids)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict endpoints)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload (lengths and prompts)")
    p.add_argument("--percentiles", default="50,90,99", help="latency percentiles reported, comma-separated")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--output", default=None, help="write the JSON report here (default: stdout only)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr (default: when stderr is a terminal)")
    return p


def _lengths(rng: random.Random, base: int, ratio: int | float, n: int) -> list[int]:
    low, high = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_workload(args: argparse.Namespace) -> list[tuple[str | list[int], int]]:
    """(prompt, max_tokens) per request, reproducible from ``--seed``."""
    rng = random.Random(args.seed)
    inputs = _lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    outputs = _lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    work = []
    for n_in, n_out in zip(inputs, outputs):
        if args.token_ids:
            prompt: str | list[int] = [rng.randrange(args.vocab_size) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        work.append((prompt, n_out))
    return work


def _payload(args: argparse.Namespace, model: str, prompt: str | list[int], max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one_request(client, url: str, headers: dict, body: dict) -> RequestResult:
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.latency = time.perf_counter() - start
        if result.output_tokens == 0:
            result.output_tokens = chunks
        result.ok = True
    except Exception as exc:  # a failed request is counted, never fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _resolve_model(client, base_url: str, headers: dict) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    import httpx

    from flashinfra.progress import progress_bar

    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.concurrency or args.num_prompts
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit + 2)) as client:
        model = args.model or await _resolve_model(client, base_url, headers)
        work = make_workload(args)
        semaphore = asyncio.Semaphore(limit)
        rng = random.Random(args.seed + 1)
        bar = progress_bar(len(work), "bench serve", "req", args.progress)

        async def limited(prompt, max_tokens):
            async with semaphore:
                result = await _one_request(client, base_url + args.endpoint, headers,
                                            _payload(args, model, prompt, max_tokens))
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(args, model, results, duration)


def _stats(values: list[float], percentiles: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, **{f"p{p:g}": None for p in percentiles}}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation between closest ranks (numpy's default)
        k = (len(ordered) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "std": statistics.pstdev(ordered),
            **{f"p{p:g}": pct(p) for p in percentiles}}


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> dict:
    percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    ok = [r for r in results if r.ok]
    ms = 1000.0
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    config = {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in vars(args).items()
              if k not in ("api_key", "func")}
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "config": config,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput_tok_s": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput_tok_s": (prompt_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft * ms for r in ok if r.ttft is not None], percentiles),
        "tpot_ms": _stats([r.tpot * ms for r in ok if r.tpot is not None], percentiles),
        "itl_ms": _stats([x * ms for r in ok for x in r.itl], percentiles),
        "e2el_ms": _stats([r.latency * ms for r in ok], percentiles),
    }


def _print_summary(report: dict) -> None:
    def fmt(v):
        return "-" if v is None else f"{v:.2f}"

    print(f"{'completed / failed':<28}{report['completed']} / {report['failed']}")
    print(f"{'duration (s)':<28}{report['duration_s']:.2f}")
    print(f"{'request throughput (req/s)':<28}{report['request_throughput_rps']:.2f}")
    print(f"{'output throughput (tok/s)':<28}{report['output_throughput_tok_s']:.2f}")
    print(f"{'total throughput (tok/s)':<28}{report['total_token_throughput_tok_s']:.2f}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = report[key]
        cells = "  ".join(f"{name}={fmt(v)}" for name, v in stats.items())
        print(f"{key:<28}{cells}")
    for error in report["errors"]:
        print(f"error: {error}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1:
        raise SystemExit("bench serve: --num-prompts must be >= 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit("bench serve: --concurrency must be >= 1")
    if not args.request_rate > 0:
        raise SystemExit("bench serve: --request-rate must be > 0")
    if args.token_ids and args.endpoint != "/v1/completions":
        raise SystemExit("bench serve: --token-ids needs --endpoint /v1/completions")
    report = asyncio.run(run_benchmark(args))
    _print_summary(report)
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0 if report["completed"] > 0 else 1
