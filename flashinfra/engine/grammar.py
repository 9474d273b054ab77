"""Constrained decoding in the engine: grammars compiled with xgrammar, one matcher per request, and the
batch's token bitmask filled on the CPU while the device runs the step.

Owns: the ``xgrammar.TokenizerInfo`` built from the checkpoint's ``tokenizer.json`` (vocabulary, byte-level
or not, EOS ids as the grammar's stop tokens; special tokens other than GLM's think/tool markers are
never allowed by a grammar), compiling a ``GrammarSpec`` (cached by spec), each request's matcher and how
many of its output tokens it has accepted, and ``GrammarMask`` (one step's bitmask of the constrained rows)
which the sampler applies to the logits before sampling. Matchers catch up on the output tokens the scheduler
appended since the last step, so preemption and recompute need nothing special. A spec ``after_think`` leaves
its row free up to the ``</think>`` token but for the stop tokens and GLM's other markers (reasoning cannot end
the output, nor call a tool); its matcher starts on the token after it. The server validates specs
(``validate_spec``) so that a bad schema is a 400, never an engine error.

``prepare`` hands the step's rows to one background thread and returns at once: the matchers catch up and
xgrammar fills the bitmask (in chunks on ``fill_threads`` threads; its calls release the GIL) straight into a
preallocated host buffer (pinned on a GPU), the constrained rows only, while the caller launches the forward
pass. ``GrammarMask.apply`` waits for it, copies the buffer to the device in one asynchronous copy and masks the
logits in one kernel (``flashinfra.kernels.token_bitmask``). At most one fill is in flight: every other use of
the runtime waits for it first, so only the fill thread touches the matchers while it runs.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from flashinfra.engine.sched.messages import GrammarSpec
from flashinfra.kernels.token_bitmask import apply_token_bitmask
from flashinfra.model.staging import StagingBuffers

# GLM's markers stay matchable (a tool-call grammar names them); every other special token is blanked
# in the grammar's vocabulary, so no grammar can produce it as text.
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                 "<arg_value>", "</arg_value>")
_COMPILED_CACHE_SIZE = 256
JSON_KINDS = ("json_schema", "json_object")
# The fill's chunks run on threads kept for the runtime's life (xgrammar would start its own anew on every call,
# which costs more than a small batch's whole fill); a thread takes at least this many bitmask words (rows x
# ceil(V / 32)), and the launching thread keeps a core of its own.
FILL_THREADS_MAX = 8
WORDS_PER_FILL_THREAD = 2**14


def fill_threads(num_rows: int, words: int) -> int:
    """Threads filling the bitmask of ``num_rows`` matchers of ``words`` words a row."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(FILL_THREADS_MAX, cores - 1, num_rows, -(-num_rows * words // WORDS_PER_FILL_THREAD)))


def _xgr():
    import xgrammar

    return xgrammar


def tokenizer_info(tokenizer_file: Path, vocab_size: int, stop_token_ids: list[int]):
    """``xgrammar.TokenizerInfo`` from a ``tokenizer.json`` (no transformers needed)."""
    from tokenizers import Tokenizer

    xgr = _xgr()
    tok = Tokenizer.from_file(str(tokenizer_file))
    spec = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab = []
    for i in range(vocab_size):
        piece = tok.id_to_token(i)
        vocab.append("" if piece is None or (piece in special and piece not in MARKER_TOKENS) else piece)
    decoder = json.dumps(spec.get("decoder"))
    if '"ByteLevel"' in decoder:
        vocab_type, prefix_space = xgr.VocabType.BYTE_LEVEL, False
    elif '"ByteFallback"' in decoder:
        vocab_type, prefix_space = xgr.VocabType.BYTE_FALLBACK, '"Metaspace"' in decoder
    else:
        vocab_type, prefix_space = xgr.VocabType.RAW, False
    return xgr.TokenizerInfo(vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=prefix_space)


def validate_spec(spec: GrammarSpec) -> None:
    """Raise ``ValueError`` saying what is wrong if ``spec`` cannot compile (tokenizer-independent check)."""
    xgr = _xgr()
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            xgr.Grammar.from_regex(choice_regex(choices))
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.spec)
        elif spec.kind != "json_object":
            raise ValueError(f"unknown grammar kind {spec.kind!r}")
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and its own types) for bad input
        lines = str(exc).strip().splitlines()
        # xgrammar prefixes its messages with "[time] /source/file.cc:line: "
        raise ValueError(re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", lines[0]) if lines else type(exc).__name__) from exc


def choice_regex(choices: list[str]) -> str:
    specials = set(r"\.^$|?*+()[]{}/")
    return "|".join("(" + "".join("\\" + c if c in specials else c for c in choice) + ")" for choice in choices)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32 in xgrammar's bitmask layout (token i is bit i % 32 of word i // 32)."""
    V = allowed.shape[0]
    padded = torch.zeros(-(-V // 32) * 32, dtype=torch.int64)
    padded[:V] = allowed.to(torch.int64)
    words = (padded.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass
class _Tracked:
    matcher: object
    num_accepted: int = 0  # output tokens the matcher has accepted, from answer_start on
    error: str | None = None
    answer_start: int | None = 0  # index of the first output token under the grammar; None: still reasoning
    num_scanned: int = 0  # output tokens searched for </think> so far


class GrammarMask:
    """One step's constraint, filled in the background from ``GrammarRuntime.prepare`` on: ``rows``, the batch rows
    under a grammar in bitmask order (the others are free), ``errors``, the batch rows whose matcher failed and why;
    both wait for the fill. It lives in its runtime's buffers: valid until the runtime's next ``prepare``."""

    def __init__(self, fill: Future, buffers: StagingBuffers, capacity: int, words: int, vocab_size: int) -> None:
        self._fill, self._buffers = fill, buffers
        self._capacity, self._words, self.vocab_size = capacity, words, vocab_size
        self._rows, self._errors = None, {}
        self._device: tuple[torch.Tensor, torch.Tensor] | None = None

    def wait(self) -> GrammarMask:
        if self._rows is None:
            self._rows, self._errors = self._fill.result()
        return self

    @property
    def rows(self) -> list[int]:
        return self.wait()._rows

    @property
    def errors(self) -> dict[int, str]:
        return self.wait()._errors

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask [k, W], logits row of each [k] int32) on ``device``, after one copy of the buffer."""
        if self._device is None:
            n, W, k = self._capacity, self._words, len(self.rows)
            dev = self._buffers.upload(n * W + n)
            if dev.device != device:
                dev = dev[: n * W + n].to(device)
            self._device = (dev[: k * W].view(k, W), dev[n * W : n * W + k])
        return self._device

    def apply(self, logits: torch.Tensor, batch_rows: list[int] | None = None) -> torch.Tensor:
        """Set disallowed logits to -inf in place. ``logits`` holds the batch rows ``batch_rows`` (all of
        them, in order, when None)."""
        if not self.rows:
            return logits
        bitmask, rows = self._on(logits.device)
        if batch_rows is not None:  # a subset of the rows (a row sampled alone): its mask rows, gathered
            where = {r: i for i, r in enumerate(batch_rows)}
            pairs = [(k, where[r]) for k, r in enumerate(self.rows) if r in where]
            if not pairs:
                return logits
            picked = torch.tensor([k for k, _ in pairs], device=logits.device)
            bitmask = bitmask.index_select(0, picked)
            rows = torch.tensor([i for _, i in pairs], dtype=torch.int32, device=logits.device)
        return apply_token_bitmask(logits, bitmask, rows, min(self.vocab_size, logits.shape[-1]))


class GrammarRuntime:
    """Compiled grammars and per-request matchers of one engine."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, stop_token_ids: list[int], max_threads: int = 4,
                 device: torch.device | str = "cpu"):
        """``max_threads``: the compiler's; ``device``: where the masked logits live."""
        xgr = _xgr()
        max_threads = max(1, min(max_threads, os.cpu_count() or 1))
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # bitmask words per row
        info = tokenizer_info(tokenizer_file, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        # JSON grammars here use no whitespace but single spaces, so a JSON output never holds a byte below
        # 0x20; xgrammar's length-bounded string rule lets such tokens through (found by the schema tests),
        # so they are masked for JSON kinds on top of the grammar's own mask.
        no_control = torch.tensor([not any(b < 0x20 for b in piece) for piece in info.decoded_vocab[:vocab_size]]
                                  + [False] * max(0, vocab_size - len(info.decoded_vocab)), dtype=torch.bool)
        self._json_allowed = pack_bits(no_control)
        from tokenizers import Tokenizer

        markers = {m: Tokenizer.from_file(str(tokenizer_file)).token_to_id(m) for m in MARKER_TOKENS}
        self.think_end_id = markers["</think>"]
        # reasoning before the answer: any token the grammar's vocabulary keeps, but the stop tokens and the
        # markers other than </think>
        reasoning = torch.tensor([bool(piece) for piece in info.decoded_vocab[:vocab_size]]
                                 + [False] * max(0, vocab_size - len(info.decoded_vocab)), dtype=torch.bool)
        for marker, token in markers.items():
            if token is not None and token < vocab_size:
                reasoning[token] = marker == "</think>"
        reasoning[[t for t in stop_token_ids if t < vocab_size]] = False
        self._reasoning_allowed = pack_bits(reasoning)
        self._compiled: dict[tuple[str, str], object] = {}
        self._tracked: dict[str, _Tracked] = {}
        # one single-threaded xgrammar BatchGrammarMatcher per chunk of the fill, the first on the fill thread
        self._fillers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(FILL_THREADS_MAX)]
        self._buffers = StagingBuffers(device, share_on_cpu=True)  # [n, W] bitmask words, then n logits rows
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
        self._helpers = ThreadPoolExecutor(max_workers=FILL_THREADS_MAX - 1, thread_name_prefix="grammar-fill-chunk")
        self._pending: Future | None = None

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int, stop_token_ids,
                  device: torch.device | str = "cpu") -> GrammarRuntime:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json; constrained decoding needs it")
        return cls(path, vocab_size, sorted(stop_token_ids), device=device)

    def compile(self, spec: GrammarSpec):
        key = (spec.kind, spec.spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            c = self.compiler
            if spec.kind == "json_schema":
                compiled = c.compile_json_schema(spec.spec, any_whitespace=False)
            elif spec.kind == "json_object":
                # an object, not any JSON value; properties not limited (strict mode would allow only {})
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.spec)
            elif spec.kind == "choice":
                compiled = c.compile_regex(choice_regex(json.loads(spec.spec)))
            elif spec.kind == "structural_tag":
                compiled = c.compile_structural_tag(spec.spec)
            else:
                raise ValueError(f"unknown grammar kind {spec.kind!r}")
            if len(self._compiled) >= _COMPILED_CACHE_SIZE:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
        return compiled

    def _track(self, request_id: str, spec: GrammarSpec) -> _Tracked:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            try:
                tracked = _Tracked(_xgr().GrammarMatcher(self.compile(spec)))
            except Exception as exc:
                tracked = _Tracked(None, error=f"grammar failed to compile: {exc}")
            if spec.after_think and self.think_end_id is not None:
                tracked.answer_start = None
            self._tracked[request_id] = tracked
        return tracked

    def _find_answer(self, tracked: _Tracked, out: list[int], length: int) -> None:
        """Set ``answer_start`` once ``out[:length]`` holds ``</think>`` (searching only the new tokens)."""
        for i in range(tracked.num_scanned, length):
            if out[i] == self.think_end_id:
                tracked.answer_start = i + 1
                return
        tracked.num_scanned = length

    def _catch_up(self, rows: list[tuple[_Tracked, list[int], int]]) -> None:
        """Each matcher accepts the output tokens it has not seen (``out[answer_start + num_accepted : length]``);
        the rows with one new token, a decode step's, in one call."""
        single = []
        for tracked, out, length in rows:
            at = tracked.answer_start + tracked.num_accepted
            if length - at == 1:
                single.append((tracked, out[at]))
                continue
            for token in out[at:length]:
                if not tracked.matcher.accept_token(token):
                    tracked.error = f"token {token} does not follow the request's grammar"
                    break
            tracked.num_accepted = length - tracked.answer_start
        if single:
            accepted = _xgr().BatchGrammarMatcher.batch_accept_token([t.matcher for t, _ in single],
                                                                    [token for _, token in single])
            for (tracked, token), ok in zip(single, accepted):
                tracked.num_accepted += 1
                if not ok:
                    tracked.error = f"token {token} does not follow the request's grammar"
        for tracked, _, _ in rows:
            if tracked.error is None and tracked.matcher.is_terminated():
                tracked.error = "the grammar is complete but generation did not stop"

    def _fill_bitmask(self, matchers: list, bitmask: torch.Tensor) -> None:
        """``bitmask[i]`` from ``matchers[i]``, in contiguous chunks on ``fill_threads`` threads (the calls release
        the GIL), the first chunk on this thread."""
        threads = fill_threads(len(matchers), self.words)
        bounds = [len(matchers) * i // threads for i in range(threads + 1)]
        chunks = [self._helpers.submit(self._fillers[i].batch_fill_next_token_bitmask, matchers[a:b], bitmask[a:b])
                  for i, (a, b) in enumerate(zip(bounds[1:-1], bounds[2:]), start=1)]
        self._fillers[0].batch_fill_next_token_bitmask(matchers[: bounds[1]], bitmask[: bounds[1]])
        for chunk in chunks:
            chunk.result()

    def prepare(self, rows: list[tuple[str, GrammarSpec | None, list[int]]]) -> GrammarMask | None:
        """Start filling the bitmask of one step's sampled rows: (request id, grammar or None, output tokens so far,
        which the scheduler does not change before the step is sampled); returns at once."""
        constrained = [(b, rid, spec, out, len(out)) for b, (rid, spec, out) in enumerate(rows) if spec is not None]
        if not constrained:
            return None
        self.wait()
        n, W = len(constrained), self.words
        host = self._buffers.reserve(n * W + n)
        self._pending = self._worker.submit(self._fill, constrained, host)
        return GrammarMask(self._pending, self._buffers, n, W, self.vocab_size)

    @torch.inference_mode()  # as the runner's thread, which may have made the buffers
    def _fill(self, constrained: list, host: torch.Tensor) -> tuple[list[int], dict[int, str]]:
        """On the fill thread: the bitmask rows in ``host`` ([n, W] at word 0: JSON rows, other grammar rows, rows
        still reasoning, the failed rows left out) and the batch row of each at word ``n * W``; returns (those batch
        rows, errors)."""
        n, W = len(constrained), self.words
        caught, reasoning, errors = [], [], {}
        for b, rid, spec, out, length in constrained:
            tracked = self._track(rid, spec)
            if tracked.error is None and tracked.answer_start is None:
                self._find_answer(tracked, out, length)
                if tracked.answer_start is None:
                    reasoning.append(b)
                    continue
            if tracked.error is not None:
                errors[b] = tracked.error
                continue
            caught.append((b, spec, tracked, out, length))
        self._catch_up([(tracked, out, length) for _, _, tracked, out, length in caught])
        json_rows, grammar_rows = [], []
        for b, spec, tracked, _, _ in caught:
            if tracked.error is not None:
                errors[b] = tracked.error
                continue
            (json_rows if spec.kind in JSON_KINDS else grammar_rows).append((b, tracked.matcher))
        filled = json_rows + grammar_rows
        bitmask = host[: n * W].view(n, W)
        if filled:
            self._fill_bitmask([m for _, m in filled], bitmask)
            if json_rows:
                bitmask[: len(json_rows)] &= self._json_allowed
        if reasoning:
            bitmask[len(filled) : len(filled) + len(reasoning)] = self._reasoning_allowed
        order = [b for b, _ in filled] + reasoning
        host.numpy()[n * W : n * W + len(order)] = order
        return order, errors

    def wait(self) -> None:
        """Wait for the fill in flight, if any (its errors are its mask's to raise)."""
        if self._pending is not None:
            wait([self._pending])
            self._pending = None

    def release(self, request_ids) -> None:
        self.wait()
        for rid in request_ids:
            self._tracked.pop(rid, None)

    @property
    def num_tracked(self) -> int:
        self.wait()
        return len(self._tracked)
