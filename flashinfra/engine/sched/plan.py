"""The two objects through which the scheduler and the model runner meet.

``Plan``: what to compute in one step (which requests, how many new tokens each, where their cache lives).
``StepResult``: what the runner produced (one sampled token per request that reached its end, with
logprobs; or an error confined to that request). Pure Python (and msgspec); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from flashinfra.engine.sched.messages import MultiModalItem, SamplingParams, TokenLogprob

# asynchronous scheduling: a token of a request's that the step in flight is still sampling; the runner feeds
# that step's sampled token in its place, on the device
PLACEHOLDER_TOKEN = -1


class ScheduledRequest(msgspec.Struct, frozen=True):
    """One request's part of a step (made per running request per step: a struct, whose construction costs a fifth
    of a frozen dataclass's)."""

    request_id: str
    # the new tokens fed this step: all_token_ids[context_len : context_len + n], the last one PLACEHOLDER_TOKEN
    # while the step that samples it is in flight
    token_ids: list[int]
    context_len: int  # tokens already in the cache (0: the request starts fresh in its KDA slot)
    # every block the request owns, in order: the request's own list, not a copy (it only grows by appends while
    # ``blocks_epoch`` stays the same), so read it during the step and keep no reference
    block_table: list[int]
    state_slot: int
    sample: bool  # this step reaches the request's last token, so a next token is sampled
    sampling: SamplingParams
    prompt_token_ids: list[int]  # read-only views for penalties
    output_token_ids: list[int]
    load_state_from: int | None = None  # prefix hit: copy this checkpoint slot into state_slot first
    # prefix checkpoints crossed this step, (position, checkpoint slot): the slot receives the KDA state after
    # the request's first ``position`` tokens (context_len < position <= context_len + n), written inside the
    # step or, at its end, copied from state_slot after it
    save_states: tuple[tuple[int, int], ...] = ()
    mm_items: tuple[MultiModalItem, ...] = ()  # images/videos whose span overlaps this step's tokens
    # speculative decoding: up to this many draft tokens may follow token_ids (the runner drafts them;
    # their cache space is allocated); the step's result then lists the emitted tokens in ``emitted``
    num_draft: int = 0
    blocks_epoch: int = 0  # the request's ``blocks_epoch``: a change means ``block_table`` was replaced

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Plan:
    step_id: int
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # freed since the last plan (runner drops state)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepResult:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> next token
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # only for requests that asked
    errors: dict[str, str] = field(default_factory=dict)  # request id -> message; fails that request only
    # rows scheduled with ``num_draft > 0``: every token emitted (the accepted drafts' targets and the one
    # after them, 1 .. num_draft + 1); all but the last were fed this step and are now in the cache
    emitted: dict[str, list[int]] = field(default_factory=dict)
    emitted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # one per emitted token, if asked
