"""One tree-size controller per class of the drafter's evidence (engine/spec_evidence.py) and the
n-gram drafter's evidence (engine/drafters/ngram.py)."""

from __future__ import annotations

from engine.drafters.base import Evidence
from engine.drafters.ngram import STRONG_MATCH, NgramDrafter
from engine.spec_evidence import ByEvidence


def test_ngram_evidence_is_strong_after_a_long_enough_match():
    d = NgramDrafter()
    assert isinstance(d, Evidence) and d.classes == 2
    d.begin([1, 2, 3, 4, 9, 9, 9])
    assert d.evidence() == 0  # "9 9 9" occurred only here, and "9 9" / "9" are too short
    d.observe([9])  # now "9 9 9" also ended at the token before, with a 9 after it
    assert d.evidence() == 1
    d.begin([5, 1, 2, 3, 4, 6, 2, 3])
    assert d.evidence() == 0  # "2 3" matched (2 tokens < STRONG_MATCH): weak
    d.observe([4])
    assert d.evidence() == (1 if STRONG_MATCH <= 3 else 0)  # "2 3 4" matched
    short = NgramDrafter(max_ngram=2)
    short.begin([1, 2, 3, 1, 2, 3, 1, 2])
    assert short.evidence() == 0  # it never looks at matches long enough to be strong


class Scripted:
    """A drafter whose evidence is set by the test."""

    classes = 2

    def __init__(self) -> None:
        self.value = 0

    def evidence(self) -> int:
        return self.value


def test_each_class_has_its_own_controller():
    drafter = Scripted()
    by = ByEvidence(drafter, 16)
    assert isinstance(drafter, Evidence)
    assert by.at(0) is not by.at(1) and [a.budget for a in by.arms] == [0, 1, 4, 16]
    assert [a.budget for a in by.at(0).arms] == [0, 1]  # weak rounds: at most WEAK_BUDGET guesses
    # weak rounds: the one-guess tree emits one token and costs more than a plain round; strong
    # rounds: the trees emit up to 7 tokens. Each class's controller settles on its own answer.
    for i in range(300):
        drafter.value = i % 2
        c = by.at(by.now())
        budget = c.fitting(16)
        if drafter.value == 0:
            c.record(budget, 1, 10.0 if budget == 0 else 12.0 + budget)
        else:
            c.record(budget, 1 if budget == 0 else min(budget, 6) + 1, 10.0 if budget == 0 else 12.0 + budget)
    assert by.at(0).fitting(16) == 0
    assert by.at(1).fitting(16) == 4  # 5 tokens in 16 ms: the best rate of the trees


def test_hindsight_goes_to_the_class_it_was_seen_in():
    by = ByEvidence(Scripted(), 16)
    told: dict[int, list] = {0: [], 1: []}
    for c, controller in enumerate(by.controllers):
        controller.observe = told[c].extend  # type: ignore[method-assign]
    by.observe([(1, 2, 0), (4, 5, 1), (16, 1, 0)])
    assert told == {0: [(1, 2), (16, 1)], 1: [(4, 5)]}  # (a budget a class lacks is its controller's to drop)


def test_with_hindsight_only_the_weaker_classes_wait_for_it_to_try_a_tree():
    # weak evidence: the hindsight says the one-guess tree would miss, and it is never tried; strong
    # evidence: the climb starts blind, as without hindsight (gated, it climbed later where guesses
    # hit: fewer tokens per forward on code and chat)
    drafter = Scripted()
    by = ByEvidence(drafter, 16, hindsight=True)
    assert by.at(0).hindsight and not by.at(1).hindsight
    assert not ByEvidence(drafter, 16).at(0).hindsight
    weak = []
    for _ in range(200):
        c = by.at(0)
        b = c.fitting(16)
        weak.append(b)
        c.record(b, 1, 10.0 if b == 0 else 12.0)
        by.observe([(1, 1, 0), (4, 1, 0), (16, 1, 0)])
    assert set(weak) == {0}
    assert by.at(1).fitting(16) == 1  # the strong class's climb: the one-guess tree first, blind
