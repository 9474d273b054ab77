"""Constrained decoding in the engine: grammars compiled with xgrammar, one matcher per request, and the
batch's token bitmask filled on the CPU.

Owns: the ``xgrammar.TokenizerInfo`` built from the checkpoint's ``tokenizer.json`` (vocabulary, byte-level
or not, EOS ids as the grammar's stop tokens; special tokens other than GLM's think/tool markers are
never allowed by a grammar), compiling a ``GrammarSpec`` (cached by spec), each request's matcher and how
many of its output tokens it has accepted, and ``GrammarMask`` (the [rows, ceil(V / 32)] int32 bitmask
of one step) which the sampler applies to the logits before sampling. Matchers catch up on the output
tokens the scheduler appended since the last step, so preemption and recompute need nothing special. A spec
``after_think`` leaves its row free up to the ``</think>`` token but for the stop tokens and GLM's other
markers (reasoning cannot end the output, nor call a tool); its matcher starts on the token after it.
The server validates specs (``validate_spec``) so that a bad schema is a 400, never an engine error.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashinfra.engine.sched.messages import GrammarSpec

# GLM's markers stay matchable (a tool-call grammar names them); every other special token is blanked
# in the grammar's vocabulary, so no grammar can produce it as text.
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                 "<arg_value>", "</arg_value>")
_COMPILED_CACHE_SIZE = 256


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


@dataclass
class GrammarMask:
    """One step's constraint: ``bitmask`` [len(rows), W] int32 for the batch rows in ``rows`` (the others
    are free); ``errors`` maps batch rows whose matcher failed to a message."""

    bitmask: torch.Tensor
    rows: list[int]
    vocab_size: int
    errors: dict[int, str] = field(default_factory=dict)

    def apply(self, logits: torch.Tensor, batch_rows: list[int] | None = None) -> torch.Tensor:
        """Set disallowed logits to -inf in place. ``logits`` holds the batch rows ``batch_rows`` (all of
        them, in order, when None)."""
        where = {r: i for i, r in enumerate(batch_rows if batch_rows is not None else range(logits.shape[0]))}
        pairs = [(where[r], k) for k, r in enumerate(self.rows) if r in where]
        if not pairs:
            return logits
        full = torch.full((logits.shape[0], self.bitmask.shape[1]), -1, dtype=torch.int32)  # -1: all allowed
        full[[i for i, _ in pairs]] = self.bitmask[[k for _, k in pairs]]
        vocab = min(self.vocab_size, logits.shape[-1])
        _xgr().apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), vocab_size=vocab)
        return logits


class GrammarRuntime:
    """Compiled grammars and per-request matchers of one engine."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, stop_token_ids: list[int], max_threads: int = 4):
        xgr = _xgr()
        max_threads = max(1, min(max_threads, os.cpu_count() or 1))
        self.vocab_size = vocab_size
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
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int, stop_token_ids) -> GrammarRuntime:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json; constrained decoding needs it")
        return cls(path, vocab_size, sorted(stop_token_ids))

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

    def _find_answer(self, tracked: _Tracked, out: list[int]) -> None:
        """Set ``answer_start`` once the output holds ``</think>`` (searching only the new tokens)."""
        for i in range(tracked.num_scanned, len(out)):
            if out[i] == self.think_end_id:
                tracked.answer_start = i + 1
                return
        tracked.num_scanned = len(out)

    def prepare(self, rows: list[tuple[str, GrammarSpec | None, list[int]]]) -> GrammarMask | None:
        """The bitmask for one step's sampled rows: (request id, grammar or None, output tokens so far).
        Each matcher first accepts the output tokens it has not seen."""
        constrained = [(b, rid, spec, out) for b, (rid, spec, out) in enumerate(rows) if spec is not None]
        if not constrained:
            return None
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(len(constrained), self.vocab_size)
        mask = GrammarMask(bitmask, [b for b, *_ in constrained], self.vocab_size)
        matchers, fill_rows, reasoning_rows = [], [], []
        for k, (b, rid, spec, out) in enumerate(constrained):
            tracked = self._track(rid, spec)
            if tracked.error is None and tracked.answer_start is None:
                self._find_answer(tracked, out)
                if tracked.answer_start is None:
                    reasoning_rows.append(k)
                    continue
            while tracked.error is None and tracked.answer_start + tracked.num_accepted < len(out):
                token = out[tracked.answer_start + tracked.num_accepted]
                if not tracked.matcher.accept_token(token):
                    tracked.error = f"token {token} does not follow the request's grammar"
                tracked.num_accepted += 1
            if tracked.error is None and tracked.matcher.is_terminated():
                tracked.error = "the grammar is complete but generation did not stop"
            if tracked.error is not None:
                mask.errors[b] = tracked.error
                continue
            matchers.append(tracked.matcher)
            fill_rows.append(k)
        if matchers:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, fill_rows)
            json_rows = [k for k in fill_rows if constrained[k][2].kind in ("json_schema", "json_object")]
            if json_rows:
                bitmask[json_rows] &= self._json_allowed
        if reasoning_rows:
            bitmask[reasoning_rows] = self._reasoning_allowed
        return mask

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._tracked.pop(rid, None)

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)
