"""Wire messages between the server process and the engine process.

Everything that crosses the ZeroMQ boundary is one of these msgspec structs, encoded as msgpack (never
pickle). The tagged unions ``ServerToEngine`` and ``EngineToServer`` are what each side decodes. The same
structs are used in-process by the offline ``LLM`` API.
"""

from __future__ import annotations

import math

import msgspec

FINISH_REASONS = ("stop", "length", "abort", "error")


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "structural_tag")


class GrammarSpec(msgspec.Struct, frozen=True):
    """Constrained decoding for one request, compiled in the engine (``flashinfra.engine.grammar``):
    ``json_schema`` (spec: the schema as JSON text), ``json_object`` (any JSON object; spec unused),
    ``regex`` (spec: the pattern), ``choice`` (spec: a JSON list of the allowed strings),
    ``structural_tag`` (spec: an xgrammar structural tag as JSON; tool calls). ``after_think``: the output
    first reasons freely up to ``</think>`` (it cannot stop before it), and the grammar applies after it."""

    kind: str
    spec: str = ""
    after_think: bool = False


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling and stopping parameters (tokens only; stop strings live in the server)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # reproducible per request, independent of the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0 = only the sampled one)
    grammar: GrammarSpec | None = None  # constrained decoding (token masks); None: unconstrained

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy: dividing logits by them would overflow."""
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalties: sampling reads the counts of the request's tokens."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, max_model_len: int) -> None:
        """Raise ``ValueError`` naming the offending field if any parameter is out of range."""

        def bad(field: str, value: object, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter {field}={value!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.max_tokens > max_model_len:
            raise bad("max_tokens", self.max_tokens, f"exceeds the model's maximum length {max_model_len}")
        for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                      "repetition_penalty"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(field, value, "must be a finite number")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 disables it)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", self.seed, "must be an integer in [0, 2**63)")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "must be an integer in [0, 20]")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise bad("grammar", self.grammar.kind, f"must be one of {', '.join(GRAMMAR_KINDS)}")


class MultiModalItem(msgspec.Struct, frozen=True):
    """An image or video in a prompt: its resized uint8 canvas and where its placeholder tokens lie.

    The span ``[offset, offset + length)`` of the prompt holds the item's placeholder (image pad) tokens,
    and for a video the frame markers between them; the encoder's rows fill the pad tokens in order.
    ``content_hash`` identifies the pixels (encoder cache and prefix cache key)."""

    kind: str  # "image" | "video"
    content_hash: str
    offset: int
    length: int
    grid: tuple[int, int, int]  # (t, h, w) patches
    shape: tuple[int, int, int, int]  # canvas [frames, 3, H, W]
    pixels: bytes  # uint8 canvas, C order
    num_embeds: int  # encoder rows = pad tokens in the span (t * h * w / merge^2)

    @property
    def end(self) -> int:
        return self.offset + self.length


class TransferParams(msgspec.Struct, frozen=True):
    """Disaggregated serving: ``export`` (prefill role) computes the prompt and its first token, then sends
    the request's cache state to the decode engine at ``peer``; ``import`` (decode role) waits for the
    state sent under ``transfer_id`` and continues from it (``flashinfra.disagg.roles``)."""

    transfer_id: str
    role: str  # "export" | "import"
    peer: str = ""  # export: the decode engine's state address
    encoder: str = ""  # export: the encode engine that encodes the prompt's images/videos (empty: this engine)


class EngineRequest(msgspec.Struct, tag=True):
    """A new generation request, already tokenized by the server."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    mm_items: list[MultiModalItem] = []
    transfer: TransferParams | None = None


class EngineRequests(msgspec.Struct, tag=True):
    """Requests sent together, such as the ``n`` choices of one prompt. An image or video that several of
    them hold travels once: ``shared_media`` leaves its pixels in the first item of each content hash and
    empties the later ones, and ``with_media`` gives the later ones the first's bytes (one object, no copy)."""

    requests: list[EngineRequest]

    @classmethod
    def shared_media(cls, requests: list[EngineRequest]) -> EngineRequests:
        seen: set[str] = set()
        out = []
        for request in requests:
            items = []
            for item in request.mm_items:
                if item.content_hash in seen:
                    item = msgspec.structs.replace(item, pixels=b"")
                seen.add(item.content_hash)
                items.append(item)
            out.append(msgspec.structs.replace(request, mm_items=items) if request.mm_items else request)
        return cls(out)

    def with_media(self) -> list[EngineRequest]:
        pixels: dict[str, bytes] = {}
        out = []
        for request in self.requests:
            items = []
            for item in request.mm_items:
                if item.pixels:
                    pixels.setdefault(item.content_hash, item.pixels)
                elif item.content_hash in pixels:
                    item = msgspec.structs.replace(item, pixels=pixels[item.content_hash])
                items.append(item)
            out.append(msgspec.structs.replace(request, mm_items=items) if request.mm_items else request)
        return out


class AbortRequest(msgspec.Struct, tag=True):
    """Stop these requests now (client gone, stop string seen); unknown ids are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Ask the engine process to exit its loop cleanly."""


class TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class RequestOutput(msgspec.Struct):
    """The tokens a request produced in one engine step (an incremental delta, not the whole text)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0


class EngineStats(msgspec.Struct):
    num_waiting: int
    num_running: int
    cache_usage: float  # fraction of paged KV blocks held by requests (cached prefixes alone count as free)
    num_preemptions_total: int
    state_slot_usage: float = 0.0  # fraction of KDA state slots in use
    num_blocks_total: int = 0
    num_blocks_free: int = 0  # free or held only by the prefix cache
    num_prefix_hit_tokens_total: int = 0
    num_prompt_tokens_total: int = 0
    num_generation_tokens_total: int = 0
    num_requests_finished_total: int = 0
    step_duration_s: float = 0.0
    num_batched_tokens: int = 0
    num_encoded_items_total: int = 0  # images/videos run through the vision tower
    num_encoder_cache_hits_total: int = 0  # images/videos a step needed and found in the encoder cache
    num_transfers_held: int = 0  # prefill role: finished requests whose blocks wait for the decode side's ack
    num_transfers_total: int = 0  # request states sent (prefill role) or imported (decode role)
    num_transfer_failures_total: int = 0
    num_encoder_cache_misses_total: int = 0  # images/videos a step needed and had to encode
    encoder_seconds_total: float = 0.0  # time spent in the vision tower
    encoder_cache_bytes: int = 0  # encoder outputs held by the encoder cache


class EngineOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats | None


class EngineReady(msgspec.Struct, tag=True):
    """Sent once by the engine process when the model is loaded and the cache allocated."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int] = []
    num_blocks: int = 0
    block_size: int = 0
    max_num_seqs: int = 0
    role: str = "both"  # disaggregated serving: "prefill" | "decode" | "both"
    transfer_address: str = ""  # decode role: where request states are received
    transfer_backend: str = "zmq"  # prefill/decode roles: how cache bytes move (--transfer-backend)
    cache_layout: dict | None = None  # prefill/decode roles: the engine's CacheLayout (flashinfra.disagg.layout)
    vision: str = ""  # what makes image embeddings: "tower" (loaded here), "encoder" (an encode engine) or "" (none)
    cache_bytes: int = 0  # every cache tensor the engine allocated (the MTP layer's and the drafts' state included)
    cache_bytes_per_token: int = 0  # of a cached token, every layer's entries
    state_bytes_per_seq: int = 0  # of a sequence slot: KDA states and conv windows (+ ReplaySSM ring, last hidden)


class EngineError(msgspec.Struct, tag=True):
    """The engine process failed fatally (e.g. the model could not be loaded); it exits after sending."""

    message: str


ServerToEngine = EngineRequest | EngineRequests | AbortRequest | Shutdown
EngineToServer = EngineOutputs | EngineReady | EngineError

_encoder = msgspec.msgpack.Encoder()
_server_decoder = msgspec.msgpack.Decoder(ServerToEngine)
_engine_decoder = msgspec.msgpack.Decoder(EngineToServer)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_server_message(data: bytes) -> EngineRequest | EngineRequests | AbortRequest | Shutdown:
    """Decode what the server sends to the engine."""
    return _server_decoder.decode(data)


def decode_engine_message(data: bytes) -> EngineOutputs | EngineReady | EngineError:
    """Decode what the engine sends to the server."""
    return _engine_decoder.decode(data)
