"""The KDA and conv correctness cases (flashinfra/kernels/kda/check_cases.py, which the registered checks run
too) as assertions for the interpreter's tests (CPU, small sizes) and the GPU's (real sizes), and the tiny
model's greedy tokens with the kernels and with their references."""

from __future__ import annotations

import torch

from flashinfra.feedback.registry import CheckResult
from flashinfra.kernels.kda import check_cases as lib
from flashinfra.kernels.kda import check_intra_cases as intra_lib
from flashinfra.kernels.kda import conv, decode as layer, prefill as pre

NAN = lib.NAN
f64, offsets, tolerances, layer_decode_inputs = lib.f64, lib.offsets, lib.tolerances, lib.layer_decode_inputs


def assert_passed(results: list[CheckResult]) -> None:
    bad = [r.summary() for r in results if not r.passed]
    assert results and not bad, "\n".join(bad) or "no results"


def assert_close(name, out, ref, rel: float, atol: float, rtol: float):
    assert_passed([lib.close(name, out, ref, rel, atol, rtol)])


def prefill_varlen(*args, **kwargs):
    assert_passed(lib.prefill_varlen(*args, **kwargs))


def layer_decode(*args, **kwargs):
    assert_passed(lib.layer_decode(*args, **kwargs))


def layer_decode_micro_batches(*args, **kwargs):
    assert_passed(lib.layer_decode_micro_batches(*args, **kwargs))


def prefill_checkpoints(*args, **kwargs):
    assert_passed(lib.prefill_checkpoints(*args, **kwargs))


def conv_checkpoints(*args, **kwargs):
    assert_passed(lib.conv_checkpoints(*args, **kwargs))


def conv_prefill(*args, **kwargs):
    assert_passed(lib.conv_prefill(*args, **kwargs))


def conv_decode(*args, **kwargs):
    assert_passed(lib.conv_decode(*args, **kwargs))


def gate_scratch(*args, **kwargs):
    assert_passed(intra_lib.gate_scratch(*args, **kwargs))


def intra_diag(*args, **kwargs):
    assert_passed(intra_lib.intra_diag(*args, **kwargs))


def intra_offdiag(*args, **kwargs):
    assert_passed(intra_lib.intra_offdiag(*args, **kwargs))


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt`` then decode ``steps`` tokens greedily, one sequence, through the model's forward."""
    from flashinfra.model.forward_batch import ForwardBatch

    bs, dev = 16, model.device
    table = list(range((len(prompt) + steps + bs - 1) // bs))
    cache = model.allocate_cache(len(table), bs, 2)
    batch = ForwardBatch.build([len(prompt)], [0], [1], [table], bs, dev)
    hidden = model.forward(torch.tensor(prompt, device=dev), batch, cache)
    logits = [model.compute_logits(hidden[-1:])[0]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        batch = ForwardBatch.build([1], [len(prompt) + i], [1], [table], bs, dev)
        hidden = model.forward(torch.tensor(tokens[-1:], device=dev), batch, cache)
        logits.append(model.compute_logits(hidden)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def tiny_model_greedy_same(tmp_path, monkeypatch, device: str, steps: int = 8):
    """The tiny model's greedy tokens (prefill + decode) are the same with the KDA/conv kernels and with their
    references. Every other op runs its reference in both runs, so only these kernels are compared."""
    from flashinfra.kernels import dispatch
    from flashinfra.model.api import load_model
    from flashinfra.model.factory import write_tiny_checkpoint

    mine = (conv, layer, pre)
    calls = {}
    for mod in mine:
        for name in [n for n in vars(mod) if n.endswith("_launch")]:
            def counted(*args, _f=getattr(mod, name), _n=name, **kwargs):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*args, **kwargs)

            monkeypatch.setattr(mod, name, counted)
    monkeypatch.setattr(dispatch, "_reference_forced", lambda: True)
    model = load_model(write_tiny_checkpoint(tmp_path / "tiny", seed=1), dtype="float32", device=device)
    prompt = torch.randint(1, model.config.text.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    for mod in mine:
        monkeypatch.setattr(mod, "use_triton", lambda *tensors: True)
    fast, fast_logits = greedy(model, prompt, steps)
    for name in ("kda_prefill_gated_launch", "kda_layer_decode_launch", "causal_conv1d_prefill_launch"):
        assert calls.get(name, 0) > 0, f"{name} never ran: {calls}"
    for mod in mine:
        monkeypatch.setattr(mod, "use_triton", lambda *tensors: False)
    ref, ref_logits = greedy(model, prompt, steps)
    assert fast == ref
    for a, b in zip(fast_logits, ref_logits):
        assert float((a - b).norm() / b.norm()) < 1e-2
