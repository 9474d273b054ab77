"""``engine/spec_gate.DraftGate``: drafting on while a verify step's emitted tokens cover its cost over a plain step,
by a clock the test drives (through ``LLM``: ``tests/test_speculative.py``)."""

from __future__ import annotations

from flashinfra.engine import spec_gate
from flashinfra.engine.spec_gate import DraftGate


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(gate: DraftGate, clock: Clock, steps: int, rows: int, verify_s: float, plain_s: float, accepted: int):
    """``steps`` decode steps of ``rows`` rows, each of the kind the gate chose at the step before (a verify step
    takes ``verify_s`` and each of its rows accepts ``accepted`` drafts; a plain one takes ``plain_s``); -> the
    kinds taken."""
    kinds, drafting = [], True
    for _ in range(steps):
        kind = "verify" if drafting else "plain"
        gate.started(kind, rows)
        drafting = gate.decide(rows)
        kinds.append(kind)
        if kind == "verify":
            for _ in range(rows):
                gate.row(accepted)
        clock.now += verify_s if kind == "verify" else plain_s
    return kinds


def test_drafting_stops_where_the_accepted_drafts_do_not_pay_and_is_probed_again():
    clock = Clock()
    gate = DraftGate(clock)
    # a verify step costs 2 plain steps and emits 1.5 tokens a row: plain steps pay
    kinds = run(gate, clock, 200, 4, verify_s=2.0, plain_s=1.0, accepted=0)
    assert kinds[:3] == ["verify", "verify", "plain"], kinds[:6]  # verify until one is timed, then plain
    steady = kinds[20:]
    assert steady.count("plain") > 0.9 * len(steady)
    assert "verify" in steady, "drafting is probed again"
    # the probes: PROBE_STEPS verify steps after every PROBE plain ones
    runs = "".join("v" if k == "verify" else "p" for k in steady).split("p")
    assert {len(r) for r in runs if r} == {spec_gate.PROBE_STEPS}
    assert abs(gate.buckets[4].verify_s - 2.0) < 1e-9 and abs(gate.buckets[4].plain_s - 1.0) < 1e-9


def test_drafting_stays_on_where_it_pays_and_buckets_are_apart():
    clock = Clock()
    gate = DraftGate(clock)
    kinds = run(gate, clock, 200, 1, verify_s=1.5, plain_s=1.0, accepted=2)  # 3 tokens for 1.5 plain steps
    steady = kinds[20:]
    assert steady.count("verify") > 0.9 * len(steady) and "plain" in steady
    assert gate.pays(1) and 16 not in gate.buckets and gate.pays(16), "a batch size not yet seen drafts"
    # acceptance falls: the same costs no longer pay
    for _ in range(200):
        gate.row(0)
    assert not gate.pays(1)


def test_a_step_before_a_change_of_kind_is_not_timed():
    clock = Clock()
    gate = DraftGate(clock)
    gate.started("verify", 2)
    clock.now += 50.0  # a verify step followed by a plain one: its period (the catch-up's) is not counted
    gate.started("plain", 2)
    clock.now += 1.0
    gate.started("plain", 2)
    clock.now += 7.0  # a plain step followed by a prefill step: not timed either
    gate.started(None, 2)
    b = gate.buckets[2]
    assert b.verify_s is None and b.plain_s == 1.0

