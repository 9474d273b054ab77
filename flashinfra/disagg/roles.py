"""What a prefill-role or decode-role engine does beside its steps (disaggregated serving).

Prefill role (``Exporter``): a request submitted with ``TransferParams(role="export")`` runs like any other,
limited to one output token. When that first token is sampled the scheduler holds the request's blocks and state
slot (``Scheduler.held``) and the exporter sends its state to the decode engine named by ``peer``: the pages and
KDA slot (packed from the held blocks as the transfer starts: on a GPU by a copy on a side stream, sent once it
is over), the first token and the sampling generator's state; with speculative decoding also the MTP layer's
pages, the target's last hidden state and the drafts made after the first token, so that the decode engine drafts
from its first step as a colocated engine would. Both roles need ``--speculative-tokens``: the MTP layer attends
over its own cache entries at every prompt position, which only a prefill that runs it writes (a decode engine
speculating alone would stay correct, its drafts being verified, but draft from entries never written), so the
MTP cache is part of the compared layout. The request's final output is held back until the decode side
acknowledges; then the cache is freed and the output released. A refused, failed or unacknowledged transfer frees
the cache too and ends the request with an error that says why. A request with images served by an encode engine
(``TransferParams.encoder``, else ``--encoder-address``) first waits for their embeddings
(``disagg.remote_encode``); then it runs, and its prefill reads them instead of running a tower.

Decode role (``Importer``): a request submitted with ``TransferParams(role="import")`` waits, outside the
scheduler, for the state sent under its transfer id (or finds it here already: a state may beat its request).
Once it is here and the batch has room, the scheduler admits the request with a slot and blocks for its prompt
(``admit_imported``), the buffers are written into them, the generator (and the speculator's hidden state and
drafts) restored, the sender is acknowledged, and the request decodes as if it had been prefilled here (its first
output is the first token, with its logprobs when asked for). A state left in the sender's cache
(``--transfer-backend mooncake|ipc``) is read straight into blocks and a slot taken for the request first, on the
receiver's reader thread; the request joins the batch when the read is over (an abort meanwhile frees them then).
A request waits at most ``transfer_timeout_s`` for its state; a state nobody asks for within that time is refused
back to its sender.

The threads behind both (the receiver's, an encode client's) wake the engine loop through ``wake_fd``, a pipe
the loop polls beside its input socket. The sender has no thread (a Python thread waking during a step stalls
the loop at its next torch call, for the GIL): the loop polls its sockets (``wake_sockets``) and wakes by its
deadlines (``wake_deadline``).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import torch

from flashinfra.disagg.layout import CacheLayout, RequestPages, RequestState, describe, fingerprint, token_hash
from flashinfra.disagg.remote_encode import EncodedColocated, RemoteEncoding, error_output
from flashinfra.disagg.transport import StateReceiver, StateSender, TransferError
from flashinfra.disagg.wake import Wake
from flashinfra.engine.sched.messages import RequestOutput
from flashinfra.engine.sched.request import Request

ROLES = ("both", "prefill", "decode")


def _host(address: str) -> str:
    """``tcp://HOST:PORT`` -> HOST."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def engine_caches(core: Any) -> tuple:
    """What a request's state is moved from or into: the model cache, and the MTP layer's with speculation."""
    spec = core.runner.speculator
    return (core.runner.cache,) if spec is None else (core.runner.cache, spec.mtp_cache)


def engine_layout(core: Any, role: str) -> CacheLayout:
    return describe(engine_caches(core), fingerprint(core.model.config), name=f"{role} engine ({core.model.path.name})")


def check_role(config: Any) -> None:
    """``ValueError`` for settings a prefill or decode role does not support yet."""
    if config.role == "encode":
        raise ValueError("--role encode runs the vision tower alone (flashinfra serve), not an engine core")
    if config.role not in ROLES:
        raise ValueError(f"unknown role {config.role!r}; choose one of {', '.join(ROLES)}")
    if config.encoder_address and (not config.enable_vision or config.role == "decode"):
        raise ValueError("--encoder-address is where a prefill (or both) engine started with --enable-vision takes "
                         "its images' embeddings from")
    if config.role == "both":
        return
    if config.tensor_parallel_size > 1 or config.expert_parallel_size > 1:
        raise ValueError(f"--role {config.role} runs on one rank (no tensor/expert parallelism)")


class Exporter:
    """Prefill role: sends finished requests' states and frees their cache on the decode side's ack."""

    def __init__(self, core: Any, config: Any) -> None:
        self.core = core
        self.wake = Wake()
        self.layout = engine_layout(core, "prefill")
        kw = dict(timeout_s=config.transfer_timeout_s, max_inflight=config.max_num_seqs * 4)
        if config.transfer_backend == "mooncake":
            from flashinfra.disagg.mooncake import MooncakeSender

            self.sender = MooncakeSender(self.layout, engine_caches(core), host=_host(config.transfer_address), **kw)
        elif config.transfer_backend == "ipc":
            from flashinfra.disagg.ipc import IpcSender

            self.sender = IpcSender(self.layout, engine_caches(core), **kw)
        else:
            self.sender = StateSender(self.layout, **kw)
        self._held_outputs: dict[str, RequestOutput] = {}
        self._transfer_ids: dict[str, str] = {}  # transfer id -> request id
        self.encoding = RemoteEncoding(core, config.transfer_timeout_s, self.wake, config.encoder_address)
        self.num_total = 0
        self._num_failures = 0

    @property
    def num_failures(self) -> int:
        return self._num_failures + self.encoding.num_failures

    def admit(self, req: Request) -> bool:
        """Check an export request; whether the scheduler takes it now (not while its images are encoded
        elsewhere)."""
        if req.transfer is None or req.transfer.role != "export" or not req.transfer.peer:
            raise ValueError("a prefill-role engine takes only requests to export (kv_transfer_params with role "
                             "'export' and the decode engine's address as peer)")
        req.sampling = msgspec.structs.replace(req.sampling, max_tokens=1)
        return self.encoding.admit(req, req.transfer.encoder)

    def has_events(self) -> bool:
        """Whether ``poll`` has something to do (a transfer to send or finished, embeddings arrived)."""
        return self.wake.pending() or self.sender.has_events()

    def wake_sockets(self) -> list:
        """The sockets that, once readable, need ``poll`` (the sender's)."""
        return self.sender.wait_sockets()

    def wake_deadline(self) -> float | None:
        """When ``poll`` has something to do even if nothing woke the loop (the sender's next deadline)."""
        return self.sender.next_deadline()

    def after_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Start the transfer of every request this step finished with its first token; hold its output."""
        sched, runner = self.core.scheduler, self.core.runner
        released = []
        for out in outputs:
            req = sched.held.get(out.request_id)
            if req is None:
                released.append(out)
                continue
            gen = runner.generators.get(req.request_id)
            spec = runner.speculator
            hidden = None if spec is None else spec.hidden.get(req.request_id)
            state = RequestState(
                request_id=req.transfer.transfer_id, prompt_len=req.num_prompt_tokens,
                num_blocks=len(req.block_ids), first_token=req.output_token_ids[0],
                prompt_hash=token_hash(req.prompt_token_ids),
                generator_state=bytes(gen.get_state().numpy()) if gen is not None else b"",
                first_logprob=out.logprobs[0] if out.logprobs else None,
                hidden=b"" if hidden is None else bytes(hidden.cpu().view(torch.uint8).numpy()),
                drafts=[] if spec is None else list(spec.drafts.get(req.request_id, [])))
            pages = RequestPages(engine_caches(self.core), list(req.block_ids), req.state_slot)
            try:
                self.sender.send(req.transfer.peer, state, pages)
            except TransferError as e:
                sched.release_held(req.request_id)
                self._num_failures += 1
                released.append(error_output(req, f"cannot send the request's cache: {e}"))
                continue
            self._held_outputs[req.request_id] = out
            self._transfer_ids[state.request_id] = req.request_id
        return released

    def poll(self) -> list[RequestOutput]:
        self.wake.drain()
        outputs = self.encoding.poll()
        for transfer_id, error in self.sender.poll():
            rid = self._transfer_ids.pop(transfer_id, None)
            if rid is None:
                continue
            out = self._held_outputs.pop(rid)
            self.core.scheduler.release_held(rid)
            if error is None:
                self.num_total += 1
                outputs.append(out)
            else:
                self._num_failures += 1
                outputs.append(RequestOutput(rid, [], None, True, "error", error=f"cache transfer failed: {error}",
                                             num_prompt_tokens=out.num_prompt_tokens))
        return outputs

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        # a transfer under way ends by its ack or its timeout, which free the cache
        return self.encoding.abort(request_ids)

    def close(self) -> None:
        self.sender.close()
        self.encoding.close()
        self.wake.close()


class Importer:
    """Decode role: receives request states and admits their requests when they arrive."""

    def __init__(self, core: Any, config: Any) -> None:
        self.core = core
        self.timeout_s = config.transfer_timeout_s
        self.wake = Wake()
        self.layout = engine_layout(core, "decode")
        if config.transfer_backend == "mooncake":
            from flashinfra.disagg.mooncake import MooncakeReceiver

            self.receiver = MooncakeReceiver(self.layout, engine_caches(core), config.transfer_address, self.wake,
                                             host=_host(config.transfer_address))
        elif config.transfer_backend == "ipc":
            from flashinfra.disagg.ipc import IpcReceiver

            self.receiver = IpcReceiver(self.layout, engine_caches(core), config.transfer_address, self.wake)
        else:
            self.receiver = StateReceiver(self.layout, config.transfer_address, wake=self.wake)
        self.address = self.receiver.address
        self._waiting: dict[str, tuple[Request, float]] = {}  # transfer id -> (request, deadline)
        self._arrived: dict[str, Any] = {}  # transfer id -> Arrival
        self._aborted: dict[str, float] = {}  # transfer id -> when its request was aborted
        # states read in place (``disagg.in_place``): the request holds blocks and a slot outside the batch from
        # the read's start until it joins the batch; transfer id -> request, and -> the finished read's error
        # (None: read)
        self._reading: dict[str, Request] = {}
        self._read: dict[str, str | None] = {}
        self.num_total = 0
        self.num_failures = 0

    def admit(self, req: Request) -> bool:
        """Check an import request and wait for its state (the scheduler never takes it directly)."""
        if req.transfer is None or req.transfer.role != "import":
            raise ValueError("a decode-role engine takes only requests to import (kv_transfer_params with role "
                             "'import' and the transfer id the prefill engine was given)")
        tid = req.transfer.transfer_id
        if tid in self._waiting:
            raise ValueError(f"duplicate transfer id {tid!r}")
        self._waiting[tid] = (req, time.monotonic() + self.timeout_s)
        if tid in self._arrived:  # the state came first: nothing else would wake the loop to import it
            self.wake()
        return False

    def has_events(self) -> bool:
        """Whether ``poll`` has something to do: a state arrived, or a wait ran out."""
        if self.wake.pending():
            return True
        now = time.monotonic()
        return (any(d < now for _, d in self._waiting.values())
                or any(now - a.time > self.timeout_s for a in self._arrived.values()))

    def wake_sockets(self) -> list:
        return []  # its threads wake the loop through ``wake``

    def wake_deadline(self) -> float | None:
        return None

    def after_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        return outputs

    def poll(self) -> list[RequestOutput]:
        self.wake.drain()
        outputs, now = [], time.monotonic()
        for arrival in self.receiver.poll():
            tid = arrival.state.request_id
            if self._aborted.pop(tid, None) is not None:  # nobody waits for it: free the sender's blocks now
                self.receiver.ack(arrival.peer, tid, "the request was aborted on the decode engine")
            else:
                self._arrived[tid] = arrival
        for tid, error in self.receiver.poll_reads() if self.receiver.reads_in_place else []:
            if tid in self._waiting:
                self._read[tid] = error
            else:  # aborted during the read: now that it is over, the blocks can go
                self._release(tid, "the request was aborted on the decode engine")
        for tid, when in list(self._aborted.items()):
            if now - when > self.timeout_s:
                del self._aborted[tid]
        for tid, (req, deadline) in list(self._waiting.items()):
            arrival = self._arrived.get(tid)
            if arrival is None:
                if now > deadline:
                    del self._waiting[tid]
                    self.num_failures += 1
                    outputs.append(error_output(req, f"no cache state arrived from the prefill engine within "
                                                      f"{self.timeout_s:g} s (transfer {tid})"))
                continue
            out = self._import(req, arrival)
            if out is not None:
                del self._waiting[tid]
                self._arrived.pop(tid, None)
                outputs.append(out)
        for tid, arrival in list(self._arrived.items()):
            if tid not in self._waiting and tid not in self._reading and now - arrival.time > self.timeout_s:
                del self._arrived[tid]
                self.receiver.ack(arrival.peer, tid, f"no request for this transfer reached the decode engine "
                                                     f"within {self.timeout_s:g} s")
        return outputs

    def _import(self, req: Request, arrival: Any) -> RequestOutput | None:
        state: RequestState = arrival.state
        problem = None
        if state.prompt_len != req.num_prompt_tokens or state.prompt_hash != token_hash(req.prompt_token_ids):
            problem = (f"the prefill engine computed other prompt tokens ({state.prompt_len} tokens) than this "
                       f"request's ({req.num_prompt_tokens} tokens)")
        elif state.num_blocks != -(-state.prompt_len // self.core.scheduler.cache.block_size):
            problem = f"{state.num_blocks} blocks sent for a {state.prompt_len}-token prompt"
        if problem is not None:
            self.receiver.ack(arrival.peer, state.request_id, problem)
            self.num_failures += 1
            return error_output(req, f"cache transfer refused: {problem}")
        sched, runner = self.core.scheduler, self.core.runner
        in_place = self.receiver.reads_in_place and arrival.source is not None and bool(arrival.source.remote)
        if in_place:
            if not self._state_read(req, arrival):
                return None  # the read is under way, or waits for room
            error = self._read.pop(state.request_id)
            if error is not None:
                self._release(state.request_id, error)
                self.num_failures += 1
                return error_output(req, f"cache transfer failed: {error}")
        out = sched.admit_imported(req, state.first_token, state.first_logprob)
        if out is None:
            if in_place:
                self._read[state.request_id] = None
            return None  # no room yet; retried on the next step
        self._reading.pop(state.request_id, None)
        try:
            # finished already (the first token stopped it): its blocks are free, nothing to write
            if req.block_ids and not in_place:
                self.receiver.write(arrival, engine_caches(self.core), req.block_ids, req.state_slot)
            if runner.speculator is not None and state.hidden and not req.is_finished:
                hidden = torch.frombuffer(bytearray(state.hidden), dtype=torch.uint8)
                runner.speculator.hidden.set(req.request_id, req.state_slot, hidden.view(runner.model.dtype))
                runner.speculator.drafts[req.request_id] = list(state.drafts)
            if state.generator_state and not req.is_finished:
                gen = torch.Generator(device=runner.device)
                gen.set_state(torch.frombuffer(bytearray(state.generator_state), dtype=torch.uint8))
                runner.generators[req.request_id] = gen
        except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
            self.receiver.ack(arrival.peer, state.request_id, f"{type(e).__name__}: {e}")
            self.num_failures += 1
            self.core.scheduler.abort([req.request_id])  # frees what it took; its output is the error below
            return error_output(req, f"cache transfer could not be imported: {type(e).__name__}: {e}")
        self.receiver.ack(arrival.peer, state.request_id)
        self.num_total += 1
        return out

    def _state_read(self, req: Request, arrival: Any) -> bool:
        """Whether the state left in the sender's cache is read into ``req``'s blocks (or failed to be); else
        start the read when the batch and the cache have room for the request."""
        tid = arrival.state.request_id
        if tid in self._read:
            return True
        if tid in self._reading:
            return False
        sched = self.core.scheduler
        if (len(sched.running) + len(self._reading) >= sched.config.max_num_seqs
                or not sched.cache.try_allocate(req, req.num_prompt_tokens)):
            return False
        self._reading[tid] = req
        self.receiver.read(arrival, engine_caches(self.core), req.block_ids, req.state_slot)
        return False

    def _release(self, tid: str, error: str) -> None:
        """Free the blocks a read in place took (over now) and tell the sender why its state was not taken."""
        self.core.scheduler.cache.free(self._reading.pop(tid))
        self._read.pop(tid, None)
        self.receiver.ack(self._arrived.pop(tid).peer, tid, error)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        ids, outputs = set(request_ids), []
        for tid, (req, _) in list(self._waiting.items()):
            if req.request_id in ids:
                del self._waiting[tid]
                if tid in self._read:  # read, not in the batch yet: free its blocks now
                    self._release(tid, "the request was aborted on the decode engine")
                elif tid in self._reading:  # a read under way frees them when it is over
                    pass
                elif tid in self._arrived:  # arrived, not imported: the sender frees its blocks on this answer
                    self.receiver.ack(self._arrived.pop(tid).peer, tid, "the request was aborted on the decode engine")
                else:  # answered when it arrives
                    self._aborted[tid] = time.monotonic()
                outputs.append(RequestOutput(req.request_id, [], None, True, "abort",
                                             num_prompt_tokens=req.num_prompt_tokens))
        return outputs

    def close(self) -> None:
        self.receiver.close()
        self.wake.close()


def make_role(core: Any, config: Any) -> Exporter | Importer | EncodedColocated | None:
    check_role(config)
    if config.role == "prefill":
        return Exporter(core, config)
    if config.role == "decode":
        return Importer(core, config)
    return EncodedColocated(core, config) if config.encoder_address else None
