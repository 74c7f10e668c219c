"""The controller told the target's confidence (engine/spec_gate.py): nothing tried while the
target is unsure where trees are costly (not where they are cheap), the climb from four nodes where
it is sure, the gate lifted by a drafter right where it is unsure, and a tree tried at once when the
text turns sure."""

from __future__ import annotations

import pytest

from engine.spec_control import FIRST, MAX_REVISIT, TRIES, SpecController
from engine.spec_gate import CONF_GATE, CONF_KEEP
from tests.unit.test_spec_control import drive, hits


def drive_confident(c: SpecController, outcome, rounds: int) -> list[int]:
    """As drive, where outcome(budget, round) -> (tokens, ms, the target's confidence at each
    emitted token), told after each record as the engine does."""
    chosen = []
    for i in range(rounds):
        b = c.budget()
        chosen.append(b)
        tokens, ms, confidence = outcome(b, i)
        c.record(b, tokens, ms)
        c.confide([confidence] * tokens)
    return chosen


def test_the_confidence_is_a_moving_average_a_token_at_a_time():
    c = SpecController(16)
    c.confide([0.2])
    assert c.confidence == 0.2
    c.confide([1.0, 1.0])
    assert c.confidence == pytest.approx(1.0 - 0.8 * CONF_KEEP ** 2)


def test_where_the_target_is_unsure_nothing_is_tried():
    # every guess misses where the target is unsure: after the first try nothing but plain rounds,
    # for longer than the longest re-try spacing; without the confidence re-tries come
    unsure = lambda b, i: (1, 10.0 + b, CONF_GATE / 2)  # noqa: E731
    chosen = drive_confident(SpecController(16), unsure, 3 * MAX_REVISIT)
    assert chosen[0] == FIRST and set(chosen[1:]) == {0}
    assert set(drive(SpecController(16), lambda b: (1, 10.0 + b), 3 * MAX_REVISIT)[2 * TRIES :]) == {0, FIRST}


def test_where_the_target_is_sure_the_climb_starts_at_four_nodes():
    sure = lambda b, i: (*hits(b), 0.95)  # noqa: E731
    chosen = drive_confident(SpecController(16), sure, 12)
    # the first round has no confidence yet: the smallest tree; then four nodes, sixteen, plain
    assert chosen[:7] == [FIRST, 4, 4, 16, 16, 0, 0]
    assert chosen[7:] == [16] * 5


def costly(b: int) -> float:
    """A tree round's ms where trees are costly (a plain round: 10): the four-node tree 2.2 plain
    rounds, more than GATE_COST."""
    return 20.0 + 0.5 * b if b else 10.0


def stretches(tree_ms):
    """Hits where the target is sure, misses where it is unsure, in stretches of 30 rounds."""
    def outcome(b, i):
        sure = (i // 30) % 2 == 0
        return (hits(b)[0] if sure else 1), tree_ms(b), 0.95 if sure else 0.3

    return outcome


def test_unsure_stretches_pause_the_trees_and_sure_ones_resume_them():
    chosen = drive_confident(SpecController(16), stretches(costly), 120)
    for start in (30, 90):  # unsure: plain once the average has come down (a few tokens)
        assert set(chosen[start + 3 : start + 30]) == {0}
    assert chosen[60 + 3 : 90].count(16) >= 24  # sure again: the full tree at once, no climb


def test_where_trees_are_cheap_an_unsure_target_does_not_shut_them_out():
    # the four-node tree costs 1.2 plain rounds (less than GATE_COST): in the unsure stretches the
    # controller is not gated, it goes by the rates, and so re-tries trees there as it would
    # without the confidence; with trees at 2.2 plain rounds nothing is tried there
    cheap = lambda b: hits(b)[1] if b else 10.0  # noqa: E731
    chosen = drive_confident(SpecController(16), stretches(cheap), 120)
    assert any(b > 0 for b in chosen[33:60] + chosen[93:120])
    c = SpecController(16)
    drive_confident(c, stretches(cheap), 35)
    assert c.gate.shut() and not c.gated()
    c = SpecController(16)
    drive_confident(c, stretches(costly), 35)
    assert c.gate.shut() and c.gated()


def test_a_drafter_right_where_the_target_is_unsure_lifts_the_gate():
    # a draft model that is the target on a model whose distribution is flat: every guess right,
    # the target never sure (tests/server/test_spec_edges.py)
    flat = lambda b, i: (*hits(b), 0.05) if b == 0 else (1 + b, 10.0 + 0.5 * b, 0.05)  # noqa: E731
    chosen = drive_confident(SpecController(16), flat, 40)
    assert chosen[:4] == [FIRST, 0, FIRST, 4]  # the two tries where it is unsure, then the climb
    assert chosen[-20:].count(16) >= 18


def test_one_lucky_guess_where_the_target_is_unsure_does_not_lift_it():
    guesses = iter([2, 1])
    unsure = lambda b, i: ((next(guesses, 1) if b else 1), 10.0 + b, 0.3)  # noqa: E731
    chosen = drive_confident(SpecController(16), unsure, 3 * MAX_REVISIT)
    assert chosen[:3] == [FIRST, 0, FIRST] and set(chosen[3:]) == {0}


def sure_misses_unsure_then_sure_hits(tree_ms) -> list[int]:
    """20 rounds where the target is sure but guesses miss (trees lose, plain rounds win), 30 where
    it is unsure, then sure with every guess right; a tree round costs tree_ms(budget)."""
    def outcome(b, i):
        if i < 20:
            return 1, tree_ms(b) if b else 10.0, 0.95
        if i < 50:
            return 1, tree_ms(b) if b else 10.0, 0.3
        return (1 + b, tree_ms(b), 0.95) if b else (1, 10.0, 0.95)

    return drive_confident(SpecController(16), outcome, 80)


def test_a_sure_stretch_after_an_unsure_one_is_tried_at_once(monkeypatch):
    chosen = sure_misses_unsure_then_sure_hits(lambda b: 10.0 + 2.5 * b)
    assert set(chosen[23:50]) == {0}
    # woken once the average passes CONF_WAKE (six sure tokens): four nodes, then the climb
    assert 4 in chosen[50:58] and chosen[-20:].count(16) >= 18
    # without the wake the trees wait for the re-try spacing
    monkeypatch.setattr("engine.spec_gate.CONF_WAKE", 2.0)
    assert set(sure_misses_unsure_then_sure_hits(lambda b: 10.0 + 2.5 * b)[50:70]) == {0}


def test_a_costly_tree_is_not_woken(monkeypatch):
    # the four-node tree costs four plain rounds: more than WAKE_COST
    assert set(sure_misses_unsure_then_sure_hits(lambda b: 40.0 + b)[50:70]) == {0}
    monkeypatch.setattr("engine.spec_control.WAKE_COST", 100.0)
    assert 4 in sure_misses_unsure_then_sure_hits(lambda b: 40.0 + b)[50:58]


def noisy_sixteen(b: int, i: int) -> tuple[int, float, float]:
    """Like the H200's MTP on code in its recording: a plain round 7.6 ms, a tree ~2.3-2.6 plain
    rounds whatever its size, and the 16-node tree's rounds emitting 3.5 tokens on average (1 to
    7), the target sure throughout."""
    if b == 0:
        return 1, 7.6, 0.9
    tokens = [5, 5, 2, 1, 6, 2, 3, 7, 2, 2, 4, 4, 2, 4][i % 14] if b == 16 else min(1 + b, 2)
    return tokens, 20.0 if b == 16 else 17.5, 0.9


def test_where_the_target_is_sure_a_winning_trees_unlucky_rounds_do_not_end_it(monkeypatch):
    # its rate (3.5 tokens in 20 ms, 0.17 a ms against plain rounds' 0.13) wins as measured; the
    # cautious estimate that guards where guesses miss (PRIOR, MARGIN) fell under plain rounds'
    # after a round of 1 or 2 tokens, and plain rounds ran until the next re-try
    chosen = drive_confident(SpecController(16), noisy_sixteen, 120)
    assert chosen[-90:].count(16) >= 85
    monkeypatch.setattr("engine.spec_control.SURE_AS_IS", False)
    assert drive_confident(SpecController(16), noisy_sixteen, 120)[-90:].count(16) < 20


def test_only_where_the_target_is_sure_a_tree_that_wins_by_less_than_the_margin_is_kept():
    # four nodes at 2.1 tokens in 20 ms against plain rounds' one in 10: 5 % faster, within MARGIN
    from engine.spec_control import MARGIN

    assert 1.05 < 1 + MARGIN
    c = SpecController(16)
    for _ in range(6):
        c.record(0, 1, 10.0)
        c.record(4, 2, 20.0)
        c.record(4, 2, 20.0)
        c.record(4, 3, 20.0)
    c.arms[2].tokens = 2.1
    c.gate.confidence = 0.9
    assert c.gate.sure() and c.best().budget == 4
    c.gate.confidence = CONF_GATE
    assert not c.gate.sure() and c.best().budget == 0
    c.gate.confidence = None
    assert c.best().budget == 0
