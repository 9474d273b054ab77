"""Model-level checks for ``flashinfra check``: our logits against transformers' on tiny checkpoints.

Each check builds a tiny random GLM-5.3-Flash with transformers' own ``glm5_next`` classes (constants
that transformers initialises to 0 or 1 are randomised too, so a misuse cannot hide), saves it with
``save_pretrained`` (the release format), loads it through our loader, and compares float32 logits:
a full prefill, prefill plus decode steps against transformers' cache, and a packed batch against each
prompt alone. transformers is a test dependency; without it these checks fail with that reason.
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
from pathlib import Path

from flashinfra.feedback.registry import compare, register_check

VOCAB = 512
# Whole-model criterion (issue acceptance): max |ours - ref| <= 1e-4 * max |ref| in float32. Element-wise
# float32 kernel tolerances are tighter than two float32 implementations of a deep model agree.
REL_TO_MAX = 1e-4


def _compare_logits(name: str, out, ref):
    return compare(name, out, ref, dtype="float32", atol=REL_TO_MAX * float(ref.abs().max()), rtol=0.0)

# Tiny vision tower: the checkpoint is a full Glm5NextForConditionalGeneration, loaded in seconds.
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   projection_intermediate_size=64)


# transformers' glm5_next functions that it sends to flash-linear-attention whenever that package imports, whatever
# the tensors' device; the references here run on the CPU, so they take the functions' own PyTorch bodies
_KERNELIZED = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
               "causal_conv1d_update")


@contextlib.contextmanager
def _torch_bodies():
    """transformers' glm5_next with its kernelized functions replaced by the PyTorch bodies they wrap."""
    from transformers.models.glm5_next import modeling_glm5_next as mod

    saved = {n: getattr(mod, n) for n in _KERNELIZED if hasattr(mod, n)}
    try:
        for n, fn in saved.items():
            setattr(mod, n, inspect.unwrap(fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)


def _pair(seed: int, **overrides):
    """-> (a caller of the transformers model on its PyTorch path, our LoadedModel) with the same random weights."""
    import torch
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from flashinfra.model.api import load_model
    from flashinfra.model.factory import TINY_TEXT_CONFIG

    torch.manual_seed(seed)
    text = {**TINY_TEXT_CONFIG, **overrides}
    hf = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=TINY_VISION)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.add_(0.3 * torch.randn_like(p))
    with tempfile.TemporaryDirectory(prefix="flashinfra-check-") as path:
        hf.save_pretrained(path)
        ours = load_model(path)  # weights are copied in, so the files may go

    def reference(**inputs):
        with _torch_bodies():
            return hf(**inputs)

    return reference, ours


def _prompt(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@register_check("model.logits.prefill", tags=("model", "transformers"))
def check_prefill():
    import torch

    results = []
    for kpool, topk in ((1, 6), (4, 8), (16, 32)):
        hf, ours = _pair(seed=kpool, index_kpool=kpool, index_topk=topk)
        ids = _prompt(97, kpool)
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids])).logits[0]
        results.append(_compare_logits(f"model.logits.prefill.kpool{kpool}", ours.logits([ids])[0], ref))
    return results


@register_check("model.logits.decode", tags=("model", "transformers"))
def check_decode():
    import torch

    from flashinfra.model.forward_batch import ForwardBatch

    hf, ours = _pair(seed=7)
    ids, steps, block = _prompt(29, 7), 8, 16
    table = list(range((len(ids) + steps + block - 1) // block))
    cache = ours.allocate_cache(len(table), block, 1)
    batch = ForwardBatch.build([len(ids)], [0], [0], [table], block, "cpu")
    got = [ours.compute_logits(ours.forward(torch.tensor(ids), batch, cache))[-1]]
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), use_cache=True)
        ref, hf_cache = [out.logits[0, -1]], out.cache
        for i in range(steps):
            tok = int(ref[-1].argmax())
            out = hf(input_ids=torch.tensor([[tok]]), cache=hf_cache, use_cache=True)
            ref.append(out.logits[0, -1])
            hf_cache = out.cache
            batch = ForwardBatch.build([1], [len(ids) + i], [0], [table], block, "cpu")
            got.append(ours.compute_logits(ours.forward(torch.tensor([tok]), batch, cache))[-1])
    return _compare_logits("model.logits.decode", torch.stack(got), torch.stack(ref))


@register_check("model.logits.packed", tags=("model",))
def check_packed():
    """A packed batch of prompts gives each prompt the logits it gets alone."""
    import torch

    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="flashinfra-check-") as path:
        model = load_model(write_tiny_checkpoint(Path(path), seed=3))
    prompts = [_prompt(n, n) for n in (1, 7, 64, 131)]
    packed = model.logits(prompts)
    alone = [model.logits([p])[0] for p in prompts]
    return _compare_logits("model.logits.packed", torch.cat(packed), torch.cat(alone))


@register_check("model.layers.kernels", tags=("model", "kernels"))
def check_layers_with_kernels():
    """Every layer with the kernels is as close to a higher-precision run as with the references
    (``model.layerwise``): bf16 against float32 on CUDA; on a CPU float32 against float64, which compares
    kernels only under ``TRITON_INTERPRET=1`` (otherwise both paths are the references)."""
    import torch

    from flashinfra.feedback.registry import CheckResult
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint
    from flashinfra.model.layerwise import compare_layers

    cuda = torch.cuda.is_available()
    dtype, hi, floor = ("bfloat16", torch.float32, 1e-3) if cuda else ("float32", torch.float64, 2e-3)
    with tempfile.TemporaryDirectory(prefix="flashinfra-check-") as path:
        model = load_model(write_tiny_checkpoint(Path(path), seed=2), dtype=dtype, device="cuda" if cuda else "cpu")
    errors = compare_layers(model, [_prompt(n, n) for n in (37, 5, 20)], hi)
    return [CheckResult(name=f"model.layers.kernels.{e.step}.{e.layer}", passed=e.within(2.0, floor),
                        rel_norm=e.kernel_err, dtype=dtype,
                        message=f"{e.kind}: kernel path {e.kernel_err:.2e}, reference path {e.reference_err:.2e} "
                                f"from {str(hi).replace('torch.', '')}; worst token {e.worst_token}: "
                                f"{e.worst_token_err:.2e}")
            for e in errors]
