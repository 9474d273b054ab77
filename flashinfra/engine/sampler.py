"""Sampling: from a batch of last-position logits to one next token per request, with logprobs.

Order of operations for one row (the same whether the row is alone or in a batch):

1. penalties on the raw logits: repetition (prompt + output tokens; positive logits divided, negative
   multiplied), then frequency (x count in the output) and presence (once if in the output);
2. greedy (``temperature == 0``): argmax of the penalized logits;
3. otherwise divide by the temperature, keep the ``top_k`` largest, keep the smallest prefix of the
   sorted distribution whose mass reaches ``top_p`` (computed after top-k), drop tokens whose probability
   is below ``min_p`` x the largest, renormalize, and draw with the request's own ``torch.Generator``
   (exponential race ``argmax(p / E)``, ``E ~ Exp(1)``), so a seeded request gives the same tokens in any
   batch.

A request with a grammar has its disallowed tokens set to -inf after the penalties (``grammar``: the
step's ``flashinfra.engine.grammar.GrammarMask``, filled on the CPU by the runner).

Logprobs are those of the model's distribution (log-softmax of the raw logits, before penalties and
truncation), as most OpenAI-compatible servers report them. A row whose sampling raises is reported as an
error for that request only; the other rows still get their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashinfra.engine.penalties import PenaltyStep
from flashinfra.engine.sched.messages import SamplingParams, TokenLogprob
from flashinfra.kernels.penalties import penalize_ref
from flashinfra.model.staging import Array, HostStaging


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # None only for greedy rows


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [pad] * (width - len(x)) for x in lists], dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalize ``logits`` [N, V] in place for the rows that ask for it (all such rows at once), from their token
    lists; returns ``logits``. (The runner's steps keep the counts on the device instead: ``engine/penalties.py``.)"""
    N, V = logits.shape
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not idx:
        return logits
    dev, sel = logits.device, [rows[i] for i in idx]
    for r in sel:
        if any(not 0 <= t < V for t in r.prompt_token_ids) or any(not 0 <= t < V for t in r.output_token_ids):
            raise ValueError(f"token ids must lie in [0, {V}) for penalties")
    # column V is the padding sink, dropped after the scatter
    out = _padded([r.output_token_ids for r in sel], V, dev)
    counts = torch.zeros(len(sel), V + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
    prompt = torch.zeros(len(sel), V + 1, dtype=torch.bool, device=dev)
    prompt.scatter_(1, _padded([r.prompt_token_ids for r in sel], V, dev), True)

    def col(values):
        return torch.tensor(values, dtype=logits.dtype, device=dev)[:, None]

    rows_t = torch.tensor(idx, dtype=torch.long, device=dev)
    x = penalize_ref(logits[rows_t], prompt[:, :V], counts[:, :V], col([r.params.repetition_penalty for r in sel]),
                 col([r.params.frequency_penalty for r in sel]), col([r.params.presence_penalty for r in sel]))
    logits[rows_t] = x
    return logits


def truncated_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities [N, V] after temperature, top-k, top-p and min-p (per-row parameters [N])."""
    N, V = logits.shape
    x = logits / temperature[:, None]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    keep = rank < k[:, None]  # top-k, in sorted order
    sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # top-p: keep a token if the mass strictly before it is below top_p (the first token always stays)
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= before < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def position_probs(logits: torch.Tensor, params: list[SamplingParams], sizes: list[int]) -> torch.Tensor:
    """``truncated_probs`` of rows of positions: ``sizes[r]`` consecutive rows of ``logits`` [N, V] sampled with
    ``params[r]`` (a speculative row's verified positions)."""
    def col(name, dt):
        return torch.tensor([getattr(p, name) for p, n in zip(params, sizes) for _ in range(n)], dtype=dt,
                            device=logits.device)

    return truncated_probs(logits.float(), col("temperature", torch.float32), col("top_k", torch.long),
                           col("top_p", torch.float32), col("min_p", torch.float32))


def draw_rows(fill, out: torch.Tensor, sizes: list[int], generators: list[torch.Generator | None],
              shared: torch.Generator | None) -> torch.Tensor:
    """Random numbers into ``out`` (``fill(tensor, generator)``, e.g. an exponential draw), ``sizes[r]`` consecutive
    rows for request ``r``: from its own generator where it has one (a seeded request, or any row in deterministic
    mode), so its numbers do not depend on the batch; the other rows share one draw from ``shared``: one launch for
    all of them, where a generator per row is a launch per row. -> ``out``."""
    if any(g is None for g in generators):
        if shared is None:
            raise ValueError("a non-greedy row needs a generator of its own or a shared one")
        fill(out, shared)
    at = 0
    for g, n in zip(generators, sizes):
        if g is not None:
            fill(out[at : at + n], g)
        at += n
    return out


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None],
          shared: torch.Generator | None) -> torch.Tensor:
    """One token per row by the exponential race (the noise by ``draw_rows``)."""
    noise = draw_rows(lambda t, g: t.exponential_(generator=g), torch.empty_like(probs), [1] * len(generators),
                      generators, shared)
    return torch.argmax(probs / noise, dim=-1)


def sampling_columns(params: list[SamplingParams]) -> list[Array]:
    """What sampling reads per row on the device, as ``HostStaging`` arrays (the runner packs them into its step's
    one copy): the sampled (non-greedy) rows and their temperature, top-k, top-p and min-p; the logprob rows."""
    rnd = [i for i, p in enumerate(params) if not p.greedy]
    sel = [params[i] for i in rnd]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    f32, i64, n = torch.float32, torch.int64, (len(rnd),)
    return [("random_rows", i64, rnd, n), ("temperature", f32, [p.temperature for p in sel], n),
            ("top_k", i64, [p.top_k for p in sel], n), ("top_p", f32, [p.top_p for p in sel], n),
            ("min_p", f32, [p.min_p for p in sel], n), ("logprob_rows", i64, want, (len(want),))]


def _logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                     idx: torch.Tensor | None = None):
    """(rows that ask, chosen [W], top values [W, k], top ids [W, k]) on the device; None if no row asks.
    ``idx``: the rows that ask, already on the device."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not want:
        return None
    if idx is None:
        idx = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    chosen = lp.gather(1, tokens[idx][:, None])[:, 0]
    k = max(rows[i].params.logprobs for i in want)
    top_v, top_i = (lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long()))
    return want, chosen, top_v, top_i


def _logprob_records(tokens: list[int], parts, rows: list[SamplingRow]) -> list[TokenLogprob | None]:
    """The records of ``_logprob_tensors``' ``parts``, their tensors on the host."""
    out: list[TokenLogprob | None] = [None] * len(rows)
    if parts is None:
        return out
    want, chosen, top_v, top_i = parts
    chosen, top_v, top_i = chosen.tolist(), top_v.tolist(), top_i.tolist()
    for j, i in enumerate(want):
        n = rows[i].params.logprobs
        out[i] = TokenLogprob(int(tokens[i]), chosen[j], list(zip(top_i[j][:n], top_v[j][:n])))
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> list[TokenLogprob | None]:
    """The logprob record of ``tokens`` [N] under the raw ``logits`` [N, V] for the rows that ask for one."""
    return _logprob_records(tokens.tolist(), _logprob_tensors(logits, tokens, rows), rows)


# tokens of a step still on the device, gathered into its token ids: (source, [(position in the step's flat tokens,
# index into source)]); the source is the samples (``DeviceSample.tokens``) of the step in flight
Fill = tuple[torch.Tensor, list[tuple[int, int]]]


class DeviceSample:
    """One batch's sampled tokens (``tokens`` [N] long), NaN rows and logprobs, still on the device.
    ``start_copy`` begins their copy to the host without waiting (pinned memory on a GPU); ``result`` waits for it
    and gives the tokens, logprob records and errors (a row with NaN logits fails alone)."""

    def __init__(self, tokens: torch.Tensor, bad: torch.Tensor, logprobs, rows: list[SamplingRow]) -> None:
        self.tokens, self.rows = tokens, rows
        self._device = (tokens, bad, logprobs)
        self._host = None
        self._copied = None

    def start_copy(self) -> "DeviceSample":
        tokens, bad, lp = self._device
        cuda = tokens.is_cuda
        host = [t.to("cpu", non_blocking=cuda) for t in (tokens, bad, *(lp[1:] if lp else ()))]
        self._host = (host[0], host[1], None if lp is None else (lp[0], *host[2:]))
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self

    def result(self) -> tuple[list[int | None], list[TokenLogprob | None], list[str | None]]:
        if self._host is None:
            self.start_copy()
        if self._copied is not None:
            self._copied.synchronize()
        tokens, bad, lp = self._host
        tokens, bad = tokens.tolist(), bad.tolist()
        records = _logprob_records(tokens, lp, self.rows)
        nan = "sampling failed: FloatingPointError: the model produced NaN logits"
        return ([None if b else t for t, b in zip(tokens, bad)], [None if b else r for r, b in zip(records, bad)],
                [nan if b else None for b in bad])


def sample_batch(logits: torch.Tensor, rows: list[SamplingRow], grammar=None, batch_rows: list[int] | None = None,
                 columns: dict[str, torch.Tensor] | None = None, penalties: PenaltyStep | None = None,
                 shared: torch.Generator | None = None) -> DeviceSample:
    """Sample every row of ``logits`` [N, V] in one pass, without waiting for the device. ``columns``: the device
    views of ``sampling_columns`` of these rows (default: copied here, in one copy); ``penalties``: the step's
    penalized rows from counts on the device, which count the sampled tokens too (default: from the rows' lists);
    ``shared``: the generator of the non-greedy rows without one of their own (``_draw``)."""
    raw = logits
    x = logits.float().clone()
    if penalties is not None:
        penalties.apply(x)
    else:
        apply_penalties(x, rows)
    if grammar is not None:
        grammar.apply(x, batch_rows)
    tokens = torch.argmax(x, dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if columns is None and (random_rows or any(r.params.logprobs is not None for r in rows)):
        columns = HostStaging(logits.device).upload(sampling_columns([r.params for r in rows]))
    if random_rows:
        idx = columns["random_rows"]
        probs = truncated_probs(x[idx], columns["temperature"], columns["top_k"], columns["top_p"], columns["min_p"])
        tokens[idx] = _draw(probs, [rows[i].generator for i in random_rows], shared)
    if penalties is not None:
        penalties.count(tokens)
    lp = _logprob_tensors(raw, tokens, rows, None if columns is None else columns["logprob_rows"])
    return DeviceSample(tokens, torch.isnan(raw).any(dim=-1), lp, rows)


def sample(logits: torch.Tensor, rows: list[SamplingRow], grammar=None, shared: torch.Generator | None = None
           ) -> tuple[list[int | None], list[TokenLogprob | None], list[str | None]]:
    """Next token, logprob record and error message for each row of ``logits`` [N, V] (``shared``: as for
    ``sample_batch``).

    The batch is sampled in one pass; if that raises, or a row fails, each row is retried alone so that only the
    rows that fail by themselves are reported as errors (their token is None)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"sample: logits {tuple(logits.shape)} do not match {len(rows)} rows")
    if not rows:
        return [], [], []
    used = {id(g): g for g in [r.generator for r in rows] + [shared] if g is not None}
    saved = [(g, g.get_state()) for g in used.values()]
    try:
        if not (grammar is not None and grammar.errors):
            tokens, lps, errors = sample_batch(logits, rows, grammar, shared=shared).result()
            if not any(errors):
                return tokens, lps, errors
    except Exception:
        pass
    for g, state in saved:  # a failed batch may have consumed some generators: rewind them
        g.set_state(state)
    tokens_out: list[int | None] = []
    lps_out: list[TokenLogprob | None] = []
    errors: list[str | None] = []
    for i, row in enumerate(rows):
        try:
            if torch.isnan(logits[i]).any():
                raise FloatingPointError("the model produced NaN logits")
            if grammar is not None and i in grammar.errors:
                raise ValueError(grammar.errors[i])
            t, lp, _ = sample_batch(logits[i : i + 1], [row], grammar, [i], shared=shared).result()
            tokens_out.append(t[0])
            lps_out.append(lp[0])
            errors.append(None)
        except Exception as e:  # confined to this request
            tokens_out.append(None)
            lps_out.append(None)
            errors.append(f"sampling failed: {type(e).__name__}: {e}")
    return tokens_out, lps_out, errors
