"""Model-level cases shared by the interpreter tests and the GPU tests: the model's greedy tokens and each
layer's accuracy with the kernels against the references, a quantized model's logits with the 8-bit kernels
against the references, and the decode step's fusions taken where they apply. The kernel cases live in
``flashinfra.kernels.check_cases`` and ``flashinfra.kernels.quant.check_cases``."""

from __future__ import annotations

import torch


def batched_greedy(model, prompts: list[list[int]], steps: int, bs: int = 16, feed=None):
    """Packed prefill of all prompts, then ``steps - 1`` decode steps of the whole batch; per step the tokens
    and logits. ``feed`` (tokens per step) replaces the argmax as the next input (teacher forcing)."""
    from flashinfra.model.forward_batch import ForwardBatch

    dev = model.device
    need = [-(-(len(p) + steps) // bs) for p in prompts]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1])))[::-1] for i in range(len(prompts))]
    cache = model.allocate_cache(sum(need), bs, len(prompts) + 1)
    slots = list(range(len(prompts), 0, -1))
    batch = ForwardBatch.build([len(p) for p in prompts], [0] * len(prompts), slots, tables, bs, dev)
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    hidden = model.forward(ids, batch, cache)
    logits = [model.compute_logits(hidden[torch.tensor(batch.last_token_indices, device=dev)])]
    tokens = [logits[-1].argmax(-1).tolist()]
    for i in range(steps - 1):
        batch = ForwardBatch.build([1] * len(prompts), [len(p) + i for p in prompts], slots, tables, bs, dev)
        nxt = tokens[-1] if feed is None else feed[i]
        logits.append(model.compute_logits(model.forward(torch.tensor(nxt, device=dev), batch, cache)))
        tokens.append(logits[-1].argmax(-1).tolist())
    return tokens, logits


TEXTS = ("In the beginning God created the heaven and the earth. And the earth was without form",
         "def main():", "The Python tutorial: an informal introduction to Python. In the following examples, "
         "input and output are distinguished by the presence or absence of prompts")


def tiny_model_batched_greedy_same(tmp_path, monkeypatch, device: str, dtype="float32", steps: int = 6,
                                   trained: bool = False):
    """The small random checkpoint, or the trained default model (``trained``: its predictions are decided
    by margins a rounding difference cannot flip, where a random model's often are not).
    float32: the same greedy tokens with the kernels and the references. bf16 (where rounding differs):
    with the reference's tokens fed to both, every step's logits agree to bf16 accuracy and the argmax
    agrees wherever the reference's top-2 margin exceeds twice the logits' difference."""
    from flashinfra.kernels import dispatch
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    if trained:
        from tokenizers import Tokenizer

        from flashinfra.model.factory import default_model_dir

        model = load_model(default_model_dir(), dtype=dtype, device=device)
        tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
        prompts = [tok.encode(text).ids for text in TEXTS]
    else:
        model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=2), dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in (37, 5, 20)]
    assert dispatch.use_triton(torch.empty(0, device=device)), "the kernels' path is not active"
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    ref, ref_logits = batched_greedy(model, prompts, steps)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: False)
    if dtype == "float32":
        fast, fast_logits = batched_greedy(model, prompts, steps)
        assert fast == ref
        for a, b in zip(fast_logits, ref_logits):  # the KDA chunk kernels' in-chunk products run in tf32
            assert float((a - b).norm() / b.norm()) < 2e-3
        return
    fast, fast_logits = batched_greedy(model, prompts, steps, feed=ref[:-1])
    for step, (a, b) in enumerate(zip(fast_logits, ref_logits)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 3e-2, f"step {step}"
        diff = float((a.float() - b.float()).abs().max())
        top2 = b.float().topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert torch.equal(a.argmax(-1)[decided], b.argmax(-1)[decided]), f"step {step}"


def layerwise(device: str, dtype: str, hi_dtype: torch.dtype, factor: float, floor: float, lengths=(37, 5, 20)):
    """Every layer of the small random checkpoint, fed the reference's input, is no further from the
    reference run in ``hi_dtype`` with the kernels than with the references (``model.layerwise``)."""
    import tempfile

    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.model.layerwise import compare_layers

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny_checkpoint(f"{tmp}/tiny", seed=2), dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lengths]
    errors = compare_layers(model, prompts, hi_dtype)
    assert len(errors) == 2 * (len(model.model.layers) + 1)
    bad = [e for e in errors if not e.within(factor, floor)]
    assert not bad, "\n".join(map(str, bad))
    return errors


def quant_model_kernels_match_references(tmp_path, monkeypatch, device: str, quantization: str, kv_cache_dtype: str,
                                         dtype="float32", steps: int = 3, atol=None, kda_state_dtype="float32",
                                         lengths=(37, 5, 20)):
    """One quantized model (weights and cache) run through the Triton kernels and through the references: the same
    quantized arithmetic, so the logits agree to float32 rounding (a flipped int8 code at a rounding tie aside).
    ``atol`` (also the rtol) defaults to 2e-3 under the CPU interpreter, whose dots are float32, and to 2e-2 on
    CUDA, where the float32 KDA path forms its in-chunk products in tf32 (10 mantissa bits). ``kda_state_dtype``
    bfloat16: both paths round the KDA state to bf16 where they store it (prefill, decode)."""
    from flashinfra.feedback.registry import assert_passed, compare
    from flashinfra.kernels import dispatch
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.quant.cache import CacheSpec

    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=2, tokenizer=False), dtype=dtype, device=device,
                       quantization=quantization,
                       cache_spec=CacheSpec.from_flags(kv_cache_dtype, kda_state_dtype))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lengths]
    assert dispatch.use_triton(torch.empty(0, device=device)), "the kernels' path is not active"
    if device == "cpu":  # the interpreter's e4m3 conversion mis-rounds (see check_cases): fp8 cache writes as torch
        from flashinfra.kernels.quant.act import quant_fp8_per_group_ref
        from flashinfra.quant import cache as quant_cache

        monkeypatch.setattr(quant_cache, "quant_fp8_per_group", quant_fp8_per_group_ref)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    ref = batched_greedy(model, prompts, steps + 1)[1]
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: False)
    out = batched_greedy(model, prompts, steps + 1)[1]
    if atol is None:
        atol = 2e-3 if device == "cpu" else 2e-2
    assert_passed([compare(f"quantized model ({quantization}, {kv_cache_dtype} cache, {kda_state_dtype} KDA state) "
                           f"step {i}", a, b, atol=atol,
                           rtol=atol) for i, (a, b) in enumerate(zip(out, ref))])


def w8a8_norm_fusion_leaves_logits_unchanged(tmp_path, monkeypatch, device: str, kernels: bool,
                                             lengths=(37, 5, 20)):
    """A W8A8 model's logits (prefill, then decode steps) with the RMSNorms quantizing their output for the int8
    projections (MLA's ``quant.linear.rms_norm_for``; the blocks' input norms with mHC's collapse,
    ``model.mhc.HyperConnection``) against those of the unfused path (the norm, then ``linear_8bit``'s own activation
    quantization): the same arithmetic in the same order, so bit for bit on the CPU (references or the interpreter).
    ``kernels``: the Triton path (CUDA, or the CPU interpreter), else the references.

    On CUDA the fused kernel and ``norms.rms_norm`` each sum a row's squares in the order of the register layout the
    compiler picks for that kernel (the fused one stores int8 codes too, which changes it), so a norm differs in
    its last float32 bit and, rarely, an int8 code at a rounding tie flips. There the fused logits must move by
    less than a quarter of what W8A8 itself moves them (the same checkpoint unquantized, fed the same tokens)."""
    from flashinfra.kernels import dispatch, norms
    from flashinfra.model import mhc, mla
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.quant import linear as qlinear

    checkpoint = write_tiny_checkpoint(tmp_path / "tiny", seed=2, tokenizer=False)
    model = load_model(checkpoint, dtype="float32", device=device, quantization="w8a8")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 512, (n,), generator=gen).tolist() for n in lengths]
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: not kernels)
    assert dispatch.use_triton(torch.empty(0, device=device)) == kernels
    monkeypatch.setattr(mla, "rms_norm_for", lambda x, w, eps, proj, keep: norms.rms_norm(x, w, eps))
    monkeypatch.setattr(mhc, "is_w8a8", lambda proj: False)  # the collapse's norm then gives plain rows
    tokens, unfused = batched_greedy(model, prompts, 3)
    # the run-to-run noise, named in a failure's message on CUDA (the CPU's comparison is exact)
    again = None if device == "cpu" else batched_greedy(model, prompts, 3, feed=tokens)[1]
    calls = []

    def counted(*args):
        calls.append(qlinear.is_w8a8(args[3]))
        return qlinear.rms_norm_for(*args)

    def counted_collapse(proj):
        calls.append(qlinear.is_w8a8(proj))
        return calls[-1]

    monkeypatch.setattr(mla, "rms_norm_for", counted)
    monkeypatch.setattr(mhc, "is_w8a8", counted_collapse)
    fused = batched_greedy(model, prompts, 3, feed=tokens)[1]
    assert calls and all(calls), "every norm before a projection (MoE included) feeds a W8A8 one"
    if device == "cpu":
        for step, (a, b) in enumerate(zip(fused, unfused)):
            assert torch.equal(a, b), f"step {step}: max difference {float((a - b).abs().max()):.3g}"
        return
    plain = batched_greedy(load_model(checkpoint, dtype="float32", device=device), prompts, 3, feed=tokens)[1]
    noise = [float((b - c).abs().max()) for b, c in zip(unfused, again)]
    for step, (a, b, r) in enumerate(zip(fused, unfused, plain)):
        moved, quant = float((a - b).abs().max()), float((b - r).abs().max())
        assert moved <= 0.25 * quant, (f"step {step}: fusion moved the logits by {moved:.3g}, W8A8 itself by "
                                       f"{quant:.3g}; the unfused path against itself: {noise[step]:.3g}")


def decode_fusions_taken(tmp_path, monkeypatch, device: str):
    """A decode step of a few rows on the kernel path launches mHC's mix product once, for the first block (every
    expand after it forms the next block's), and has each MoE's pairs aligned in its routing's program: no
    ``moe_align`` of its own. A prompt's step (more tokens than either fusion takes) keeps a mix per block."""
    from flashinfra.kernels import dispatch, fused_moe, mhc as hc, moe_route
    from flashinfra.model import glm5_next
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.model.moe import MoE

    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=2), dtype="float32", device=device)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: False)
    forwards: list[dict] = []

    def counted(name, fn):
        def call(*args, **kwargs):
            forwards[-1][name] += 1
            return fn(*args, **kwargs)
        return call

    def embed(ids, table, n):
        forwards.append(dict(tokens=ids.shape[0], mix=0, align=0, route_align=0))
        return hc.hc_embed(ids, table, n)

    monkeypatch.setattr(glm5_next, "hc_embed", embed)
    monkeypatch.setattr(hc, "_mix", counted("mix", hc._mix))
    monkeypatch.setattr(fused_moe, "moe_align", counted("align", fused_moe.moe_align))
    monkeypatch.setattr(moe_route, "route_align_launch", counted("route_align", moe_route.route_align_launch))
    batched_greedy(model, [[5] * 40, [7] * 3, [9] * 21], 3)
    layers = model.model.layers
    moe = sum(isinstance(layer.mlp, MoE) for layer in layers)
    prompt, *decode = forwards
    assert moe and len(decode) == 2 and all(f["tokens"] == 3 for f in decode)
    assert prompt["mix"] == 2 * len(layers) and prompt["route_align"] == 0 and prompt["align"] == moe, prompt
    for f in decode:
        assert f["mix"] == 1 and f["align"] == 0 and f["route_align"] == moe, f
