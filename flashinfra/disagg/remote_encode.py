"""Requests whose images an encode engine embeds: they wait outside the scheduler until the embeddings arrive.

``RemoteEncoding`` asks the encode engine (``disagg.encode.EncodeClient``) for the embeddings of the items a
request needs that the encoder cache lacks (keyed by content hash: an item asked for by an earlier request
and not answered yet is not asked for again), puts arrivals in that cache, and hands the request to the
scheduler once all its items are there; its prefill then reads them instead of running a tower. A failed
item, or rows of another count than the placeholders, ends the request with an error that says why.

Which encode engine: the one the request names (``TransferParams.encoder``, set by ``flashinfra router
--encode``), else the engine's ``--encoder-address``. An engine started with ``--encoder-address`` loads no
vision tower (``engine.core``); its runner's embedder only reads the encoder cache.

``EncodedColocated`` is the ``--role both`` engine started with ``--encoder-address``: this waiting, and
nothing else, beside its steps (a prefill-role engine's ``disagg.roles.Exporter`` embeds a ``RemoteEncoding``
of its own).
"""

from __future__ import annotations

from typing import Any, Callable

from flashinfra.engine.sched.messages import RequestOutput
from flashinfra.engine.sched.request import Request


def error_output(req: Request, message: str) -> RequestOutput:
    return RequestOutput(req.request_id, [], None, True, "error", error=message,
                         num_prompt_tokens=req.num_prompt_tokens)


class RemoteEncoding:
    """Holds requests until their images' embeddings are in the encoder cache; ``poll`` starts or fails them."""

    def __init__(self, core: Any, timeout_s: float, wake: Callable[[], None], default_encoder: str = "") -> None:
        self.core = core
        self.timeout_s = timeout_s
        self.wake = wake
        self.default_encoder = default_encoder
        self.client = None  # the EncodeClient, made for the first request that needs one
        self._waiting: dict[str, Request] = {}  # request id -> request waiting for its images' embeddings
        self._asked: set[str] = set()  # content hashes asked for and not answered yet
        self.num_encoded = 0  # items whose embeddings an encode engine made (here or for an earlier request)
        self.num_failures = 0

    def admit(self, req: Request, encoder: str = "") -> bool:
        """Whether the scheduler takes ``req`` now: yes without images, or with all their embeddings cached, or
        when no encode engine is named (``encoder``, else the default) and the engine's own tower encodes."""
        encoder = encoder or self.default_encoder
        if not req.mm_items or not encoder:
            return True
        cache = self.core.runner.embedder.cache
        if all(it.content_hash in cache for it in req.mm_items):
            self.num_encoded += len(req.mm_items)
            return True
        missing = {it.content_hash: it for it in req.mm_items
                   if it.content_hash not in cache and it.content_hash not in self._asked}
        if missing:
            self._client().request(encoder, list(missing.values()))
            self._asked.update(missing)
        self._waiting[req.request_id] = req
        return False

    def _client(self):
        if self.client is None:
            from flashinfra.disagg.encode import EncodeClient, embedding_layout

            model = self.core.model
            layout = embedding_layout(model.config.vision, model.config.text.hidden_size, model.dtype,
                                      name=f"{self.core.config.role} engine ({model.path.name})")
            self.client = EncodeClient(layout, timeout_s=self.timeout_s, wake=self.wake)
        return self.client

    def poll(self) -> list[RequestOutput]:
        """Put arrived embeddings in the encoder cache; start the requests that have all theirs, fail those
        whose items failed."""
        if self.client is None:
            return []
        cache, outputs = self.core.runner.embedder.cache, []
        failed: dict[str, str] = {}
        pinned = {it.content_hash for r in self._waiting.values() for it in r.mm_items}
        for content_hash, rows, error in self.client.poll():
            self._asked.discard(content_hash)
            if error is not None:
                failed[content_hash] = error
            else:
                cache.put(content_hash, rows.to(self.core.runner.device), pinned)
        for rid, req in list(self._waiting.items()):
            errors = [failed[it.content_hash] for it in req.mm_items if it.content_hash in failed]
            bad = [it for it in req.mm_items if it.content_hash in cache and cache.get(it.content_hash).shape[0]
                   != it.num_embeds]
            if errors or bad:
                del self._waiting[rid]
                self.num_failures += 1
                why = errors[0] if errors else f"{bad[0].num_embeds} embeddings expected, other rows received"
                outputs.append(error_output(req, f"the request's images could not be encoded: {why}"))
            elif all(it.content_hash in cache for it in req.mm_items):
                del self._waiting[rid]
                self.num_encoded += len(req.mm_items)
                self.core.scheduler.add_request(req)
        return outputs

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        # answers still on their way land in the cache, for whoever asks next
        return [RequestOutput(rid, [], None, True, "abort", num_prompt_tokens=self._waiting.pop(rid).num_prompt_tokens)
                for rid in request_ids if rid in self._waiting]

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class EncodedColocated:
    """``--role both`` with ``--encoder-address``: requests with images wait for their embeddings, then run."""

    layout = None  # moves no request states
    address = ""

    def __init__(self, core: Any, config: Any) -> None:
        from flashinfra.disagg.wake import Wake

        self.wake = Wake()
        self.encoding = RemoteEncoding(core, config.transfer_timeout_s, self.wake, config.encoder_address)
        self.num_total = 0  # no transfers

    @property
    def num_failures(self) -> int:
        return self.encoding.num_failures

    def admit(self, req: Request) -> bool:
        return self.encoding.admit(req)

    def has_events(self) -> bool:
        return self.wake.pending()

    def wake_sockets(self) -> list:
        return []  # the encode client's thread wakes the loop through ``wake``

    def wake_deadline(self) -> float | None:
        return None

    def after_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        return outputs

    def poll(self) -> list[RequestOutput]:
        self.wake.drain()
        return self.encoding.poll()

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return self.encoding.abort(request_ids)

    def close(self) -> None:
        self.encoding.close()
        self.wake.close()
