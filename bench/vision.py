"""Vision encoder throughput against transformers in the same run, and the time to first token of an image prompt.

Encoder: batches of ``--batch`` random square images at each ``--sizes`` edge (448, 896, 1344 by default; all
are multiples of 28, so the canvas is the image), preprocessed once; then the same patches through
transformers' ``Glm5NextVisionModel`` (sdpa attention) and through ``flashinfra.model.vision.VisionTower``
holding the same weights, alternately, ``--runs`` timed runs each after a warm-up. Reported: images/s of
each (median run), the speedup, and the largest difference of the outputs (a check that both computed the
same thing). The tower is GLM-5.3-Flash's shape (transformers' ``Glm5NextVisionConfig`` defaults: 24
layers, 1024 wide, 16 heads), random weights.

TTFT: ``flashinfra.LLM`` on the built-in default model with vision on, one prompt with one image, max_tokens=1:
cold (the encoder runs) and again with the same image (encoder cache and prefix cache hits).

``--smoke`` runs a two-layer narrow tower at small sizes on the CPU (float32): the script's own test.

usage: python bench/vision.py [--smoke] [--device cuda] [--dtype bfloat16] [--batch 16] [--sizes 448 896 1344]
                              [--runs 5] [--out bench/results/vision.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

SMOKE_VISION = dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=64,
                    projection_intermediate_size=128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, runs: int) -> list[float]:
    fn()
    _sync(device)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def build_towers(vision_kwargs: dict, dtype: torch.dtype, device: torch.device):
    from transformers import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from flashinfra.config import resolve_config
    from flashinfra.model.factory import TINY_TEXT_CONFIG
    from flashinfra.model.loader import StateDictReader
    from flashinfra.model.vision import PREFIX, VisionTower, load_vision_weights

    torch.manual_seed(0)
    hf_cfg = Glm5NextVisionConfig(**vision_kwargs)
    hf_cfg._attn_implementation = "sdpa"
    hf = Glm5NextVisionModel(hf_cfg).to(device=device, dtype=dtype).eval()
    cfg = resolve_config({"text_config": TINY_TEXT_CONFIG, "vision_config": hf_cfg.to_dict()}).vision
    with torch.device(device):
        ours = VisionTower(cfg).to(dtype)
    load_vision_weights(ours, StateDictReader({PREFIX + k: v for k, v in hf.state_dict().items()}))
    return hf, ours.eval()


def encoder_rows(hf, ours, sizes, batch, runs, dtype, device) -> list[dict]:
    from PIL import Image

    from flashinfra.multimodal.pixels import patchify
    from flashinfra.multimodal.processor import image_canvas

    rows = []
    rng = np.random.default_rng(0)
    for size in sizes:
        canvases = [image_canvas(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)))
                    for _ in range(batch)]
        patches = torch.cat([patchify(torch.from_numpy(c.pixels).to(device), "image") for c in canvases]).to(dtype)
        grids = [c.grid for c in canvases]
        grid_t = torch.tensor(grids, device=device)

        def run_hf():
            with torch.inference_mode():
                return hf(patches, grid_thw=grid_t).pooler_output

        def run_ours():
            return ours(patches, grids)

        diff = (run_hf() - torch.cat(run_ours())).abs().max().item()
        t_hf, t_ours = [], []
        for _ in range(runs):  # alternate, so drifts in clock or load hit both alike
            t_hf += _timed(run_hf, device, 1)
            t_ours += _timed(run_ours, device, 1)
        m_hf, m_ours = statistics.median(t_hf), statistics.median(t_ours)
        rows.append(dict(size=size, batch=batch, patches_per_image=grids[0][1] * grids[0][2],
                         transformers_images_per_s=batch / m_hf, flashinfra_images_per_s=batch / m_ours,
                         speedup=m_hf / m_ours, transformers_s=t_hf, flashinfra_s=t_ours, max_abs_diff=diff))
        print(f"{size}x{size} batch {batch}: transformers {batch / m_hf:8.2f} img/s, flashinfra "
              f"{batch / m_ours:8.2f} img/s, x{m_hf / m_ours:.2f} (max |diff| {diff:.2e})", flush=True)
    return rows


def ttft(size: int, device: str, dtype: str) -> dict:
    from PIL import Image

    from flashinfra import LLM, SamplingParams
    from flashinfra.feedback.timing import generated

    llm = LLM(None, enable_vision=True, device=device, dtype=dtype, max_num_seqs=4)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (size, size, 3), dtype=np.uint8))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    generated(llm, "warm up", params, images=[[Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8))]])
    out = {}
    for name in ("cold", "cached"):
        t0 = time.perf_counter()
        res = generated(llm, "Describe the image.", params, images=[[image]])[0]
        out[f"{name}_s"] = time.perf_counter() - t0
        out["prompt_tokens"] = len(res.prompt_token_ids)
    out["size"] = size
    print(f"TTFT {size}x{size} ({out['prompt_tokens']} prompt tokens): cold {out['cold_s'] * 1e3:.1f} ms, "
          f"cached {out['cached_s'] * 1e3:.1f} ms", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny tower, small sizes, CPU float32")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    smoke = args.smoke
    device = torch.device(args.device or ("cpu" if smoke or not torch.cuda.is_available() else "cuda"))
    dtype_name = args.dtype or ("float32" if smoke or device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    batch = args.batch or (2 if smoke else 16)
    sizes = args.sizes or ([56, 112] if smoke else [448, 896, 1344])
    runs = args.runs or (2 if smoke else 5)

    report = dict(
        benchmark="vision", command=" ".join([sys.executable, *sys.argv]),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, dtype=dtype_name, smoke=smoke, encoder=[],
    )
    out = Path(args.out or f"bench/results/vision{'-smoke' if smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    hf, ours = build_towers(SMOKE_VISION if smoke else {}, dtype, device)
    for size in sizes:  # written after every size: a cut-off run keeps the sizes it measured
        report["encoder"] += encoder_rows(hf, ours, [size], batch, runs, dtype, device)
        out.write_text(json.dumps(report, indent=2) + "\n")
    del hf, ours
    report["ttft"] = ttft(56 if smoke else 448, str(device), dtype_name)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
