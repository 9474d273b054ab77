"""Whether drafting pays: speculative decoding drafts only while its steps emit tokens faster than plain ones.

A verify step feeds ``k + 1`` tokens a row and emits ``1 + a`` of them (``a``: the accepted drafts); it costs more
than a plain decode step, by a factor that depends on the model, the batch and the machine, and ``a`` depends on
the text. So the gate measures both as the engine runs and drafts while

    (1 + a) x t_plain > t_verify,

``a`` an average over recent verify rows, ``t_verify`` and ``t_plain`` averages of the step period (the host's clock
from one step's start to the next's) per batch-size bucket (the power of two at or above the rows decoding). Only
steps whose rows all decode are timed, and only where the next step is of the same kind (the last plain step before
drafting resumes runs the MTP layer's deferred catch-up; ``speculative.py``). A bucket with no verify figure drafts; one with
no plain figure yet decodes plainly; after ``PROBE`` steps of one choice the other is taken for ``PROBE_STEPS``
steps, so that a change of text or of cost is seen. While drafting is off, the MTP layer's catch-up waits, as past
``--speculative-max-batch``: a plain step costs what it costs without speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

PROBE = 64  # steps of one choice before the other is measured again
PROBE_STEPS = 3  # steps of the other choice then (the first is a transition, not timed)
RATE = 0.2  # weight of a new step period in its average
ACCEPT_RATE = 0.05  # weight of a new verify row's accepted drafts in their average


@dataclass
class _Bucket:
    verify_s: float | None = None
    plain_s: float | None = None
    choice: bool = True  # the last choice
    run: int = 0  # steps of that choice in a row
    probe: int = 0  # steps of the other choice still to take


class DraftGate:
    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.accepted: float | None = None  # accepted drafts per verify row, averaged
        self.buckets: dict[int, _Bucket] = {}
        self._last: tuple[str | None, int, float] | None = None  # the step under way: kind, rows, start
        self.num_verify_steps = 0
        self.num_plain_steps = 0

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def started(self, kind: str | None, rows: int) -> None:
        """A step starts: ``kind`` "verify" (rows all decode, some with drafts), "plain" (rows all decode, none
        with drafts) or None (prefill rows); the previous step's period is timed if it and this one are alike."""
        now = self.clock()
        if self._last is not None:
            last_kind, last_rows, start = self._last
            if last_kind is not None and last_kind == kind:
                b = self.buckets.setdefault(self.bucket(last_rows), _Bucket())
                attr = "verify_s" if last_kind == "verify" else "plain_s"
                old = getattr(b, attr)
                setattr(b, attr, now - start if old is None else old + RATE * (now - start - old))
        self._last = (kind, rows, now)
        if kind == "verify":
            self.num_verify_steps += 1
        elif kind == "plain":
            self.num_plain_steps += 1

    def row(self, accepted: int) -> None:
        """A verify row accepted ``accepted`` drafts."""
        a = self.accepted
        self.accepted = accepted if a is None else a + ACCEPT_RATE * (accepted - a)

    def pays(self, rows: int) -> bool:
        """Whether drafting pays at a batch of ``rows`` by the figures so far: unknown verify cost, yes; unknown
        plain cost, no; else the module's inequality."""
        b = self.buckets.get(self.bucket(rows))
        if b is None or b.verify_s is None:
            return True
        if b.plain_s is None:
            return False
        return (1 + (self.accepted or 0.0)) * b.plain_s > b.verify_s

    def decide(self, rows: int) -> bool:
        """Whether the step about to be scheduled after this one drafts (``pays``, with the probes); called once
        a step."""
        b = self.buckets.setdefault(self.bucket(rows), _Bucket())
        want = self.pays(rows)
        if b.probe:
            b.probe -= 1
            return not want
        b.run = b.run + 1 if want == b.choice else 1
        b.choice = want
        if b.run >= PROBE:
            b.run, b.probe = 0, PROBE_STEPS
        return want
