"""Checks and benchmarks of the sampler, registered with ``flashinfra.feedback``.

Checks (``flashinfra check sampler``) run the sampler's tensor paths on the default device (CUDA when
there is one) on fresh random inputs at odd sizes, against a direct per-row float64 computation on the
CPU. The benchmark (``flashinfra bench sampler``) times one full ``sample`` call over a batch of
GLM-5.3-Flash-vocabulary logits with mixed greedy, top-p/top-k and penalized rows.
"""

from __future__ import annotations

import torch

from flashinfra.engine.sched.messages import SamplingParams
from flashinfra.feedback.registry import BenchContext, BenchSpec, compare, register_benchmark, register_check
from flashinfra.engine.sampler import SamplingRow, apply_penalties, sample, truncated_probs

GLM_VOCAB = 154880


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def truncated_probs_ref(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row [V], float64, written the plain way: sort, cut, renormalize."""
    x = x.double().cpu() / temperature
    order = torch.argsort(x, descending=True, stable=True)
    kept = order[:top_k] if top_k > 0 else order
    p = torch.softmax(x[kept], dim=0)
    mass, n = 0.0, 0
    for v in p.tolist():
        if mass >= top_p:
            break
        mass += v
        n += 1
    chosen = [i for i in range(n) if p[i] >= min_p * p[0]]
    out = torch.zeros_like(x)
    out[kept[chosen]] = p[chosen] / p[chosen].sum()
    return out


@register_check("sampler.truncation", tags=("runner",))
def check_truncation():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    N, V = 37, 1031
    x = torch.randn(N, V, generator=g) * 3
    t = torch.rand(N, generator=g) * 1.5 + 0.2
    k = torch.randint(0, 60, (N,), generator=g)
    p = torch.rand(N, generator=g) * 0.9 + 0.1
    m = torch.rand(N, generator=g) * 0.2
    dev = _device()
    out = truncated_probs(x.to(dev), t.to(dev), k.to(dev), p.to(dev), m.to(dev))
    ref = torch.stack([truncated_probs_ref(x[i], float(t[i]), int(k[i]), float(p[i]), float(m[i])) for i in range(N)])
    return compare("sampler.truncation.probs", out, ref, dtype=torch.float32)


@register_check("sampler.penalties", tags=("runner",))
def check_penalties():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    N, V = 9, 997
    x = torch.randn(N, V, generator=g) * 2
    rows, ref = [], x.double().clone()
    for i in range(N):
        params = SamplingParams(repetition_penalty=0.5 + i / 5, presence_penalty=i / 5 - 0.8,
                                frequency_penalty=0.9 - i / 6)
        prompt = torch.randint(0, V, (31,), generator=g).tolist()
        output = torch.randint(0, V, (53,), generator=g).tolist()
        rows.append(SamplingRow(params, prompt, output, None))
        for tok in set(prompt) | set(output):
            v = ref[i, tok]
            ref[i, tok] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
        for tok in set(output):
            ref[i, tok] -= params.frequency_penalty * output.count(tok) + params.presence_penalty
    out = apply_penalties(x.to(_device()), rows)
    return compare("sampler.penalties.logits", out, ref, dtype=torch.float32)


@register_benchmark("sampler.b64", tags=("runner",))
def bench_sampler(ctx: BenchContext) -> BenchSpec:
    N, V = (8, 4096) if ctx.quick else (64, GLM_VOCAB)
    params = [SamplingParams(temperature=0.0) if i % 4 == 0 else
              SamplingParams(temperature=0.8, top_p=0.95, top_k=50 if i % 4 == 1 else 0,
                             repetition_penalty=1.1 if i % 4 == 2 else 1.0, logprobs=5 if i % 4 == 3 else None)
              for i in range(N)]

    def make_inputs(seed: int):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(N, V, generator=g).to(ctx.device)
        rows = [SamplingRow(p, torch.randint(0, V, (64,), generator=g).tolist(),
                            torch.randint(0, V, (32,), generator=g).tolist(),
                            None if p.greedy else torch.Generator(device=ctx.device).manual_seed(seed * 1000 + i))
                for i, p in enumerate(params)]
        return logits, rows

    def run(logits, rows):
        tokens, _, errors = sample(logits, rows)
        if any(errors):
            raise RuntimeError(f"sampling failed: {[e for e in errors if e]}")
        return tokens

    return BenchSpec(fn=run, make_inputs=make_inputs, bytes=N * V * 4 * 6,
                     description=f"sample() over {N} rows x {V} vocab: greedy, top-p, top-k, penalties, logprobs",
                     params={"rows": N, "vocab": V})
