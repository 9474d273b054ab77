"""Offline generation: ``flashinfra.LLM(model).generate(prompts, SamplingParams(...))``.

Runs an ``EngineCore`` in this process (no server, no ZeroMQ) and steps it until every prompt is done;
all prompts are batched together by the scheduler. Prompts are text (tokenized with the checkpoint's
``tokenizer.json``) or lists of token ids. Generation stops on EOS, ``stop_token_ids``, ``max_tokens`` or
one of the ``stop`` strings (the text ends before it, as in the server). Without sampling params the
checkpoint's ``generation_config.json`` defaults apply.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from flashinfra.engine.config import EngineConfig, config_kwargs
from flashinfra.parallel.engine import make_engine
from flashinfra.engine.sched.messages import EngineRequest, SamplingParams, TokenLogprob
from flashinfra.generation_defaults import apply_defaults, load_generation_defaults


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the checkpoint has no tokenizer
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLM:
    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        """``model``: checkpoint directory (None: the built-in default model); ``engine_args``: any other
        ``EngineConfig`` field, by the name of its flag (``num_blocks``, ``max_num_seqs``, ``dtype``...)."""
        config_kwargs(EngineConfig, engine_args)
        self.engine = make_engine(EngineConfig(model=str(model) if model is not None else None, **engine_args))
        self.tokenizer = _load_tokenizer(self.engine.model.path)
        self.generation_defaults = load_generation_defaults(self.engine.model.path)
        self._ids = itertools.count()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass prompts as token id lists")
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _await_engine(self) -> bool:
        """Wait (a second at most) for the engine's background work (an encode engine's embeddings, with
        ``encoder_address``; a cache transfer's ack, with a prefill role) to need a step; False when the engine has
        none, so nothing can finish the remaining requests."""
        if self.engine.wake_fd is None:
            return False
        from flashinfra.disagg.wake import LoopPoller

        LoopPoller(self.engine).poll(1000)
        return True

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        images: Sequence[Sequence[Any] | None] | None = None,
        videos: Sequence[Sequence[Any] | None] | None = None,
        stop: str | Sequence[str] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (batched); outputs in prompt order. Invalid input raises ValueError
        before anything runs. ``images`` / ``videos``: per prompt, a list of images (PIL, path, bytes) /
        videos (path, bytes, or a list of frames); a text prompt places them at its ``<|image|>`` /
        ``<|video|>`` marks, or before its text when it has none (needs ``LLM(..., enable_vision=True)``)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or ()) if s]
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this checkpoint has no tokenizer.json)")
        if sampling_params is None:
            sampling_params = apply_defaults(SamplingParams(), self.generation_defaults, include_max_tokens=True)
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for name, media in (("images", images), ("videos", videos)):
            if media is not None and len(media) != len(prompts):
                raise ValueError(f"{len(media)} entries of {name} for {len(prompts)} prompts (one list per prompt)")
        requests, outputs = [], {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text = prompt if isinstance(prompt, str) else None
            media = (images[i] if images else None, videos[i] if videos else None)
            if any(media):
                from flashinfra.multimodal.llm_inputs import multimodal_prompt

                ids, items = multimodal_prompt(self, prompt, *media)
            else:
                ids, items = (self.encode(prompt) if text is not None else [int(t) for t in prompt]), []
            rid = f"llm-{next(self._ids)}"
            requests.append(EngineRequest(rid, ids, p, time.time(), items))
            outputs[rid] = GenerationOutput(rid, text, ids, [], None, None, [] if p.logprobs is not None else None)
        for req in requests:
            req.sampling.validate(self.engine.max_model_len)
        added = []
        try:
            for req in requests:
                self.engine.add_request(req)
                added.append(req.request_id)
        except Exception:
            self.engine.abort(added)
            self.engine.step()
            raise
        unfinished = set(outputs)
        while self.engine.has_work() or (unfinished and self._await_engine()):
            for out in self.engine.step():
                g = outputs.get(out.request_id)
                if g is None:
                    continue
                if out.finished:
                    unfinished.discard(out.request_id)
                if g.finish_reason is not None:
                    continue  # ended by a stop string; the engine's late outputs do not count
                g.token_ids.extend(out.new_token_ids)
                if out.logprobs is not None and g.logprobs is not None:
                    g.logprobs.extend(out.logprobs)
                if out.finished:
                    g.finish_reason, g.error = out.finish_reason, out.error
                elif stops and g.finish_reason is None and self._cut_at_stop(g, stops):
                    self.engine.abort([g.request_id])
        result = [outputs[r.request_id] for r in requests]
        for g in result:
            if g.finish_reason == "stop" and g.text is not None and stops:
                continue  # cut at its stop string already
            g.text = self.decode(g.token_ids)
            if stops and g.text is not None:
                self._cut_at_stop(g, stops)
        return result

    def _cut_at_stop(self, g: GenerationOutput, stops: list[str]) -> bool:
        """If ``g``'s text contains a stop string: cut the text before it, finish with "stop"."""
        text = self.decode(g.token_ids) or ""
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if not hits:
            return False
        g.text, g.finish_reason = text[:min(hits)], "stop"
        return True


def _load_tokenizer(path: Path) -> Any:
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))
