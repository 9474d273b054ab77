"""transformers' glm5_next slice for ``hotpath_slice.py``: built and timed as the anchor did it
(``../shared/anchors/measure_anchors.py``, section ``hf_glm5_next``), and the speed-ups of ours over it."""

from __future__ import annotations

import time

import torch

# the anchor's transformers runs: (batch, prompt tokens) before the timed decode steps
HF_RUNS = ((1, 2048), (32, 512))
SMOKE_HF_RUNS = ((1, 64), (4, 16))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_hf(cfg: dict, dtype: torch.dtype, device: str):
    """transformers' slice, built as the anchor built it."""
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    hf_cfg = Glm5NextTextConfig(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Glm5NextTextModel(hf_cfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model


@torch.no_grad()
def measure_hf(model, runs: tuple[tuple[int, int], ...], steps: int, device: str) -> dict:
    """The anchor's method: one timed prefill, then ``steps`` decode steps timed after 2 untimed ones."""
    import transformers
    from transformers.cache_utils import DynamicCache

    cfg, vocab = model.config, model.config.vocab_size
    res = dict(transformers=transformers.__version__, params_B=sum(p.numel() for p in model.parameters()) / 1e9,
               warmup="one prefill of 128 tokens (16 at batch > 1) and 3 decode steps per batch size, untimed",
               decode_steps_timed=steps, runs=[])
    for B, P in runs:
        cache = DynamicCache(config=cfg)
        warm = torch.randint(0, vocab, (B, min(P, 128 if B == 1 else 16)), device=device)
        model(input_ids=warm, cache=cache, use_cache=True)
        for _ in range(3):
            model(input_ids=torch.randint(0, vocab, (B, 1), device=device), cache=cache, use_cache=True)
        del cache
        ids = torch.randint(0, vocab, (B, P), device=device)
        cache = DynamicCache(config=cfg)
        sync(device)
        t = time.perf_counter()
        model(input_ids=ids, cache=cache, use_cache=True)
        sync(device)
        prefill_s = time.perf_counter() - t
        nxt = torch.randint(0, vocab, (B, 1), device=device)
        for i in range(steps + 2):
            if i == 2:
                sync(device)
                t = time.perf_counter()
            model(input_ids=nxt, cache=cache, use_cache=True)
        sync(device)
        step_s = (time.perf_counter() - t) / steps
        res["runs"].append(dict(batch=B, prefill_tokens=P, prefill_s=prefill_s, decode_s_per_step=step_s,
                                decode_context=f"{P + 2} to {P + steps + 1}"))
        print("transformers", res["runs"][-1], flush=True)
        del cache
    return res


def speedups(hf: dict, decode_ours: list[dict], matched: list[dict], prefill_2048: dict | None) -> dict:
    """transformers' time / ours, per batch size: at transformers' own contexts and at ours."""
    out = dict(note="ours includes the logits (the embedding as head); transformers' time stops at the final norm")
    for run in hf["runs"]:
        B, t = run["batch"], run["decode_s_per_step"]
        for label, rows in (("same_context", matched), ("at_our_context", decode_ours)):
            row = next((r for r in rows if r["batch"] == B), None)
            if row is not None:
                out[f"decode_b{B}_{label}"] = dict(
                    transformers_context=run["decode_context"], ours_context=row["context"],
                    graph=t / row["graph_median_s"], eager=t / row["eager_median_s"])
        if B == 1 and prefill_2048 is not None and run["prefill_tokens"] == prefill_2048["tokens"]:
            out[f"prefill_{run['prefill_tokens']}"] = run["prefill_s"] / prefill_2048["median_s"]
    return out
