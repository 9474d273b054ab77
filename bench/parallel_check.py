"""Tensor and expert parallel correctness on one host: a sharded model's layers, logits and served greedy tokens
against the same seeded random weights computed unsharded on one GPU.

Models (bf16, random weights from one seed): ``--model slice``, ``hotpath_slice.py``'s 4-layer full-width slice
(3 KDA + 1 MLA layer, 288-expert MoEs; here with an untied lm_head); ``--model 8layer``, GLM-5.3-Flash's first 8
layers (``parallel/plan.py``: KDA x3, MLA, KDA x3, MLA; dense MLP x3, MoE x5). ``--tp N --ep M`` as
``parallel/layout.py`` takes them, one rank per GPU under ``torchrun`` (max(tp, ep) ranks).

1. Rank 0, before the ranks join: ``flashinfra serve --load-format random --seed 0`` at this layout and, where
   the weights + 8 GiB fit one GPU (the slice's 62 GB on an H100, the 8-layer model's 78 GB only on a larger
   one), at one rank: greedy tokens of a few prompts. Tensors are drawn by name and seed: every layout has the
   same weights.
2. Every rank draws its shard (``random_shard``); rank 0 computes the one-GPU reference one whole layer at a time
   (``loader.load_part``, then freed). Each decoder layer is fed the reference's input (broadcast) in the sharded
   model, the bf16 reference and its float32 reference path (float64 in ``--smoke``), for a packed prefill of
   prompts + served tokens and one decode step, so routing flips do not compound. Per layer: max |error| /
   max |output| (sharded vs reference, each vs float32) over the tokens whose top-k expert sets agree in all
   three, and the fractions of tokens whose sets differ. The float32 layers also run their own chain.
3. Logits: the sharded head on the reference's last hidden states; the sharded model end to end against the
   reference chain (relative Frobenius error against the float32 chain: in bf16 routing flips compound).
4. Served tokens: each is the reference's argmax or within a tie, top-1 minus its logit <= 5 sigma, sigma^2 =
   2 (s_sharded^2 + s_reference^2), s = RMS over the vocabulary of (bf16 - float32 chain) logits there; the
   one-rank server's equal the sharded server's up to a first difference, whose token passes the same rule.

Tolerances (``model/layerwise.py``'s rule, with room for the reductions): a sharded error against float32 is at
most 4x the one-GPU reference's own + 1e-6 of the output's scale. Sharding adds roundings (each rank's partial
sum rounded to bf16, then each all-reduce step: sqrt(2 world - 1) = 2.6x one GEMM's at world 4); a wrong slice,
a missing reduction or a misrouted expert errs by a sub-block's whole output, hundreds of ulps. Expert-set flips
against float32: at most 4x the reference's + 2% of the tokens (counting noise). The embedding (one owned row
plus zeros) must be exact. Writes ``bench/results/parallel_check_<model>_tp<N>_ep<M>.json`` (device, command,
date) and a copy in ``--out``; exit code 1 when a check fails.

usage: torchrun --nproc-per-node 2 bench/parallel_check.py --model slice --tp 2 --out $OUT          # x2
       torchrun --nproc-per-node 4 bench/parallel_check.py --model 8layer --tp 4 --out $OUT         # x4
       torchrun --nproc-per-node 4 bench/parallel_check.py --model 8layer --tp 1 --ep 4 --out $OUT  # x4
       torchrun --nproc-per-node 2 bench/parallel_check.py --smoke --tp 2 --ep 2   # CPU, gloo, the tiny model
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hotpath_slice import slice_config  # noqa: E402
from serve_runs import running  # noqa: E402

from flashinfra.feedback.timing import header, write_results  # noqa: E402
from flashinfra.kernels.dispatch import kernel_path  # noqa: E402
from flashinfra.kernels.moe_route import route_ref  # noqa: E402
from flashinfra.model.api import model_config_from  # noqa: E402
from flashinfra.model.cache import ModelCache  # noqa: E402
from flashinfra.model.factory import TINY_TEXT_CONFIG, RandomSource  # noqa: E402
from flashinfra.model.forward_batch import ForwardBatch  # noqa: E402
from flashinfra.model.glm5_next import Glm5NextModel  # noqa: E402
from flashinfra.model.loader import load_part  # noqa: E402
from flashinfra.parallel.groups import destroy_distributed, init_distributed, make_comms  # noqa: E402
from flashinfra.parallel.layout import make_layout, world_size  # noqa: E402
from flashinfra.parallel.load import random_shard  # noqa: E402
from flashinfra.parallel.plan import GLM_5_3_FLASH, shard_meta, write_model_dir  # noqa: E402
from flashinfra.quant.linear import normed  # noqa: E402

SEED, BS = 0, 16
FACTOR, FLOOR, FLIP_SLACK, TIE_SIGMAS = 4.0, 1e-6, 0.02, 5.0
# torchrun's, kept from the servers: they start their own ranks (with TORCHELASTIC_USE_AGENT_STORE their rank 0
# would not host its own rendezvous)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def raw_config(model: str) -> dict:
    if model == "smoke":  # the tiny model with a vocabulary holding the built-in tokenizer's special tokens
        text = {**TINY_TEXT_CONFIG, "vocab_size": 4096}
    elif model == "slice":
        text = slice_config(smoke=False)
    else:
        full = GLM_5_3_FLASH["text_config"]  # its first 8 layers
        text = {**full, "num_hidden_layers": 8, **{k: full[k][:8] for k in ("layer_types", "mlp_layer_types")}}
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "tie_word_embeddings": False, "text_config": {**text, "model_type": "glm5_next_text"}}


def fits_one_gpu(cfg, smoke: bool) -> bool:
    """The whole model's weights and 8 GiB (cache, graphs, activations: ``plan.py``'s reserve) fit GPU 0."""
    if smoke:
        return True
    _, full = shard_meta(cfg, make_layout(cfg.text, 1, 1, 0), "none")
    return sum(full.values()) + 8 * 2**30 <= torch.cuda.get_device_properties(0).total_memory


def serve(args, model_dir: Path, prompts: list[list[int]], tp: int, ep: int) -> list[list[int]]:
    """Greedy token ids of ``prompts`` (one request) from ``flashinfra serve`` at ``tp`` x ``ep``."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "flashinfra", "serve", "--model", str(model_dir), "--served-model-name", "check",
           "--host", "127.0.0.1", "--port", str(port), "--load-format", "random", "--seed", str(SEED),
           "--quantization", "none", "--dtype", "float32" if args.smoke else "bfloat16", "--max-num-seqs", "4",
           "--num-blocks", "256", "--max-model-len", str(max(map(len, prompts)) + args.gen + BS),
           "--tensor-parallel-size", str(tp), "--expert-parallel-size", str(ep), "--dist-timeout-s", "1800"]
    cmd += ["--device", "cpu"] if args.smoke else []
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k in LAUNCHER_VARS or k.startswith("TORCHELASTIC_")}
    try:
        with running(cmd, port, model_dir / f"serve_tp{tp}_ep{ep}.log", timeout_s=1800.0, stop_timeout_s=120.0):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=1800.0, json={
                "model": "check", "prompt": prompts, "max_tokens": args.gen, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    finally:
        os.environ.update(saved)


def widen(module: torch.nn.Module, dtype: torch.dtype, recurse: bool = True) -> None:
    """Parameters narrower than ``dtype`` converted in place, one at a time (no second copy of the layer)."""
    for p in module.parameters(recurse=recurse):
        if p.is_floating_point() and torch.finfo(p.dtype).bits < torch.finfo(dtype).bits:
            p.data = p.data.to(dtype)


def run(layer, x: torch.Tensor, batch: ForwardBatch, cache: ModelCache, masks: dict):
    """A decoder layer's output streams and its sorted top-k expert ids per token (None for a dense MLP), routed
    again from the MoE's captured input by ``route_ref`` (the kernel's choice but for exact ties)."""
    seen = []
    hook = layer.mlp.register_forward_pre_hook(lambda _m, a: seen.append(normed(a[0])))
    try:
        out = layer(x, batch, cache, masks)
    finally:
        hook.remove()
    m = layer.mlp
    if not hasattr(m, "router_weight"):
        return out, None
    c = m.cfg
    return out, route_ref(seen[0], m.router_weight, m.router_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
                          c.norm_topk_prob, c.routed_scaling_factor)[1].sort(-1).values


def max_rel(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> float:
    """max |a - b| / max |b| over the rows ``keep`` (0 where none is kept)."""
    a, b = (a, b) if keep is None else (a[keep], b[keep])
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)) if b.numel() else 0.


def within(sharded_err: float, reference_err: float) -> bool:
    return sharded_err <= FACTOR * reference_err + FLOOR


def layer_row(i: int, step: str, layer, out: dict) -> dict:
    (sh, r_sh), (ref, r_ref), (hi, r_hi) = out["sh"], out["ref"], out["hi"]
    row = dict(layer=i, step=step, kind=("kda" if layer.is_kda else "mla") + ("+moe" if r_sh is not None else
                                                                            "+dense"), tokens=sh.shape[0])
    keep = torch.ones(sh.shape[0], dtype=torch.bool, device=sh.device)
    if r_sh is not None:
        flips = {k: (a != b).any(-1) for k, a, b in (("sh_ref", r_sh, r_ref), ("sh_hi", r_sh, r_hi),
                                                    ("ref_hi", r_ref, r_hi))}
        keep = ~(flips["sh_ref"] | flips["sh_hi"] | flips["ref_hi"])
        row.update({f"flips_{k}": float(f.float().mean()) for k, f in flips.items()})
    row.update(err_sh_ref=max_rel(sh, ref, keep), err_sh_hi=max_rel(sh, hi, keep), err_ref_hi=max_rel(ref, hi, keep),
               excluded=int((~keep).sum()))
    row["ok"] = within(row["err_sh_hi"], row["err_ref_hi"]) and (
        r_sh is None or row["flips_sh_hi"] <= FACTOR * row["flips_ref_hi"] + FLIP_SLACK)
    return row


@torch.inference_mode()
def compare(cfg, seqs: list[list[int]], nxt: list[int], layout, rank: int, device: str, dtype, hi) -> dict | None:
    """Steps 2 and 3 of the module doc on every rank (collective); rank 0 returns the rows and logits."""
    text = cfg.text
    comms = make_comms(layout)
    sharded = random_shard(cfg, layout, comms, dtype, device, SEED)
    B, lens = len(seqs), [len(s) for s in seqs]
    need = [-(-(n + 1) // BS) for n in lens]
    tables = [list(range(sum(need[:k]), sum(need[:k + 1]))) for k in range(B)]
    steps = {"prefill": (torch.tensor([t for s in seqs for t in s], device=device),
                         ForwardBatch.build(lens, [0] * B, list(range(B)), tables, BS, device)),
             "decode": (torch.tensor(nxt, device=device),
                        ForwardBatch.build([1] * B, lens, list(range(B)), tables, BS, device))}
    cache = sharded.allocate_cache(sum(need), BS, B)  # the sharded model end to end, on its own chain
    chained = {s: sharded.compute_logits(sharded.forward(ids, batch, cache)) for s, (ids, batch) in steps.items()}
    cache = sharded.allocate_cache(sum(need), BS, B)
    embedded = {s: sharded.embed(ids) for s, (ids, _) in steps.items()}
    out: dict = {"layers": []}
    if rank == 0:
        with torch.device("meta"):
            full = Glm5NextModel(text, dtype, cfg.has_lm_head)
        source = RandomSource(cfg, dtype, device, SEED)
        for part in ("embed_tokens", "norm", "lm_head") if cfg.has_lm_head else ("embed_tokens", "norm"):
            load_part(full, cfg, source, part, device)
        wide = torch.promote_types(hi, torch.float32)
        caches = {"ref": ModelCache.allocate(text, sum(need), BS, B, dtype, device),
                  "hi": ModelCache.allocate(text, sum(need), BS, B, hi, device, wide),
                  "chain": ModelCache.allocate(text, sum(need), BS, B, hi, device, wide)}
        streams = {}
        for s, (ids, _) in steps.items():
            x = full.embed_tokens[ids]
            out[f"embed_{s}_max_abs_err"] = float((embedded[s] - x).abs().max())
            x = x.unsqueeze(1).expand(-1, text.hc_mult, -1).contiguous()
            streams[s] = {"ref": x, "chain": x.to(hi)}
    masks = {(p, s): {} for p in ("sh", "ref", "hi", "chain") for s in steps}

    def from_rank0(s: str) -> torch.Tensor:
        shape = (len(steps[s][0]), text.hc_mult, text.hidden_size)
        x = streams[s]["ref"] if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(x, 0)
        return x

    for i, layer in enumerate(sharded.model.layers):
        if rank == 0:
            load_part(full, cfg, source, f"layers.{i}", device)
        outs = {}
        for s, (_, batch) in steps.items():
            x = from_rank0(s)
            outs[s] = {"sh": run(layer, x, batch, cache, masks["sh", s])}
            if rank == 0:
                outs[s]["ref"] = run(full.layers[i], x, batch, caches["ref"], masks["ref", s])
        if rank == 0:
            widen(full.layers[i], hi)
            with kernel_path(False):
                for s, (_, batch) in steps.items():
                    outs[s]["hi"] = run(full.layers[i], streams[s]["ref"].to(hi), batch, caches["hi"], masks["hi", s])
                    streams[s]["chain"] = run(full.layers[i], streams[s]["chain"], batch, caches["chain"],
                                              masks["chain", s])[0]
                    streams[s]["ref"] = outs[s]["ref"][0]
                    out["layers"].append(layer_row(i, s, full.layers[i], outs[s]))
            full.layers[i].to_empty(device="meta")
        del outs
    heads = {}
    for s in steps:
        x = from_rank0(s)
        h = sharded.compute_logits(sharded.model.final_norm(x))
        if rank == 0:
            heads[s] = {"sh": h, "ref": full.compute_logits(full.final_norm(x))}
    if rank != 0:
        return None
    widen(full, hi, recurse=False)
    with kernel_path(False):
        for s in steps:
            heads[s]["hi"] = full.compute_logits(full.final_norm(streams[s]["ref"].to(hi)))
            heads[s]["chain"] = full.compute_logits(full.final_norm(streams[s]["chain"]))
    for s, h in heads.items():
        agree = float((h["sh"].argmax(-1) == h["ref"].argmax(-1)).float().mean())
        row = dict(err_sh_ref=max_rel(h["sh"], h["ref"]), err_sh_hi=max_rel(h["sh"], h["hi"]),
                   err_ref_hi=max_rel(h["ref"], h["hi"]), argmax_agree=agree)
        out[f"head_{s}"] = {**row, "ok": within(row["err_sh_hi"], row["err_ref_hi"])}
        c = chained[s]  # the reference chain's logits are h["ref"]: its last streams fed the head
        row = dict(err_sh_ref=max_rel(c, h["ref"]), fro_sh_chain=float((c - h["chain"]).norm() / h["chain"].norm()),
                   fro_ref_chain=float((h["ref"] - h["chain"]).norm() / h["chain"].norm()),
                   argmax_agree=float((c.argmax(-1) == h["ref"].argmax(-1)).float().mean()))
        out[f"chained_{s}"] = {**row, "ok": within(row["fro_sh_chain"], row["fro_ref_chain"])}
    out["logits"] = (chained["prefill"], heads["prefill"]["ref"], heads["prefill"]["chain"])
    return out


def token_checks(prompts, served: dict, logits) -> dict:
    """Step 4 of the module doc, from the prefill logits (sharded end to end, reference chain, float32 chain)."""
    sh, ref, chain = (t.double() for t in logits)
    rms = lambda d: d.pow(2).mean(-1).sqrt()  # noqa: E731
    tol = TIE_SIGMAS * (2 * (rms(sh - chain) ** 2 + rms(ref - chain) ** 2)).sqrt()
    gap = ref.max(-1).values[:, None] - ref  # [T, V]: how far below the reference's top-1 each token is
    end, rows, first_diff = 0, {"argmax": 0, "tie": 0, "bad": 0}, []
    for k, (p, g) in enumerate(zip(prompts, served["sharded"])):
        at, end = end + len(p) - 1, end + len(p) + len(g)  # at: the position whose logits chose g[0]
        for j, t in enumerate(g):
            rows["argmax" if gap[at + j, t] == 0 else "tie" if gap[at + j, t] <= tol[at + j] else "bad"] += 1
        if "one_rank" in served:
            u = served["one_rank"][k]
            j = next((j for j, (a, b) in enumerate(zip(g, u)) if a != b), None)
            first_diff.append(None if j is None else dict(at=j, gap=float(gap[at + j, u[j]]), tol=float(tol[at + j]),
                                                          ok=bool(gap[at + j, u[j]] <= tol[at + j])))
    res = dict(tokens=sum(rows.values()), **rows, tie_tol_median=float(tol.median()),
               logit_std=float(ref.std()), ok=rows["bad"] == 0)
    if "one_rank" in served:
        equal = sum(a == b for g, u in zip(served["sharded"], served["one_rank"]) for a, b in zip(g, u))
        res.update(one_rank_equal=equal, one_rank_first_diff=first_diff,
                   ok=res["ok"] and all(d is None or d["ok"] for d in first_diff))
    return res


def table(r: dict) -> str:
    cols = {"err_sh_ref": "err sh/ref", "err_sh_hi": "sh/f32", "err_ref_hi": "ref/f32", "flips_sh_ref": "flips sh/ref",
            "flips_sh_hi": "sh/f32", "flips_ref_hi": "ref/f32"}
    lines = ["layer step    kind      " + " ".join(f"{c:>12}" for c in cols.values())]
    for x in r["layers"]:
        lines.append(f"{x['layer']:>5} {x['step']:7} {x['kind']:9} " + " ".join(
            " " * 12 if c not in x else f"{x[c]:12.3e}" if c.startswith("err") else f"{x[c]:12.3f}" for c in cols)
            + ("  ok" if x["ok"] else "  FAIL"))
    for k, v in r.items():
        if k.startswith(("head_", "chained_", "server")):
            lines.append(f"{k:16} " + " ".join(f"{n}={x:.3g}" if isinstance(x, float) else f"{n}={x}"
                                               for n, x in v.items() if n != "ok") + ("  ok" if v["ok"] else "  FAIL"))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("slice", "8layer"), default="slice")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--prompt-lens", type=int, nargs="+", help="default: 96 64 40 24 (--smoke: 12 7)")
    p.add_argument("--gen", type=int, help="greedy tokens per prompt from the servers (default: 16, --smoke: 4)")
    p.add_argument("--server", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--one-rank-server", action=argparse.BooleanOptionalAction, default=None,
                   help="also serve at one rank (default: where the model fits GPU 0)")
    p.add_argument("--smoke", action="store_true", help="the tiny model in float32 on CPU ranks over gloo")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a collective may wait")
    p.add_argument("--out", default=None, help="also copy the JSON into this folder (--smoke: only there)")
    args = p.parse_args()
    model = "smoke" if args.smoke else args.model
    args.prompt_lens = args.prompt_lens or ([12, 7] if args.smoke else [96, 64, 40, 24])
    args.gen = args.gen or (4 if args.smoke else 16)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # torchrun stopping the ranks: servers stopped too
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world != world_size(args.tp, args.ep) or world == 1:
        raise SystemExit(f"run under torchrun --nproc-per-node {world_size(args.tp, args.ep)} (max(tp, ep) > 1 "
                         f"ranks); WORLD_SIZE is {world}")
    cfg = model_config_from(raw_config(model))
    device = "cpu" if args.smoke else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    dtype, hi = (torch.float32, torch.float64) if args.smoke else (torch.bfloat16, torch.float32)
    layout = make_layout(cfg.text, args.tp, args.ep, rank)
    g = torch.Generator().manual_seed(SEED)
    high = min(cfg.text.vocab_size, 4000)
    prompts = [torch.randint(1, high, (n,), generator=g).tolist() for n in args.prompt_lens]
    nxt = torch.randint(1, high, (len(prompts),), generator=g).tolist()
    served = {}
    if rank == 0 and args.server:  # before the ranks take their GPUs
        model_dir = write_model_dir(raw_config(model), tempfile.mkdtemp(prefix=f"parallel_check_{model}_"))
        served["sharded"] = serve(args, model_dir, prompts, args.tp, args.ep)
        if fits_one_gpu(cfg, args.smoke) if args.one_rank_server is None else args.one_rank_server:
            served["one_rank"] = serve(args, model_dir, prompts, 1, 1)
        print(f"served (logs in {model_dir}): {served}", flush=True)
    init_distributed(rank, world, device, timeout_s=args.timeout)
    box = [served]
    dist.broadcast_object_list(box, 0)
    served = box[0]
    seqs = [q + s for q, s in zip(prompts, served["sharded"])] if served else prompts
    report = compare(cfg, seqs, nxt, layout, rank, device, dtype, hi)
    destroy_distributed()
    if rank != 0:
        return 0
    logits = report.pop("logits")
    if served:
        report["server"] = token_checks(prompts, served, logits)
    checks = {f"layer {x['layer']} {x['step']}": x["ok"] for x in report["layers"]}
    checks.update({k: v["ok"] for k, v in report.items() if isinstance(v, dict) and "ok" in v})
    checks.update({k: v == 0.0 for k, v in report.items() if k.startswith("embed_")})
    results = {**header(), "model": model, "tp": args.tp, "ep": args.ep, "world": world,
               "dtype": str(dtype).split(".")[-1], "exact_dtype": str(hi).split(".")[-1], "seed": SEED,
               "prompt_lens": args.prompt_lens, "served": served,
               "tolerances": dict(factor=FACTOR, floor=FLOOR, flip_slack=FLIP_SLACK, tie_sigmas=TIE_SIGMAS),
               **report, "failed": [k for k, ok in checks.items() if not ok]}
    results["ok"] = not results["failed"]
    name = f"parallel_check_{model}_tp{args.tp}_ep{args.ep}"
    path = write_results(name, results, None if args.smoke else args.out, args.out if args.smoke else None)
    print(table(results))
    print(f"{'PASS' if results['ok'] else 'FAIL ' + ', '.join(results['failed'])}: {path}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
