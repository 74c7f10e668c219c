"""Sizing each round's draft tree so that speculation does not lose to plain decoding.

A bigger tree pays when the target accepts deep enough to cover its verify cost; where guesses
miss (random text, long context, sampling at a high temperature) every round pays for a tree it
throws away. The right size depends on the hardware, the model, the drafter and the text, and it
drifts during a generation, so it is measured, per request: each candidate budget ("arm", the
root alone among them) keeps an exponentially weighted estimate of the tokens a round emits and of
the milliseconds it takes, drafting included; each round takes the arm with the best tokens per
millisecond. Every arm is tried twice at the start, and the best of the others is tried again now
and then, since what pays changes as the text changes (prior art: vLLM's dynamic speculation,
llama.cpp's draft p_min). Output is unaffected: the accept rule does not look at the tree's size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8  # weight of the history in each arm's estimates (a few rounds of memory)
TRIES = 2  # rounds of each arm before choosing
REVISIT = 16  # rounds between re-tries of the best other arm
# a bigger tree must beat a smaller one by this share of tokens per ms to be kept: round times on a
# busy machine jitter by about that much, and where every arm emits the same tokens (all guesses
# miss) only the jitter would otherwise decide, keeping trees that draft for nothing
MARGIN = 0.10


@dataclass
class Arm:
    budget: int  # draft nodes besides the root; 0 = plain decoding
    tokens: float = 0.0  # EWMA of tokens emitted per round
    ms: float = 0.0  # EWMA of a round's wall time, drafting included
    rounds: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0

    def record(self, tokens: int, ms: float) -> None:
        w = DECAY if self.rounds else 0.0
        self.tokens = w * self.tokens + (1 - w) * tokens
        self.ms = w * self.ms + (1 - w) * ms
        self.rounds += 1


@dataclass
class SpecController:
    """Chooses the budget of each round among powers of two up to `max_budget`, and 0."""

    max_budget: int
    arms: list[Arm] = field(default_factory=list)
    rounds: int = 0

    def __post_init__(self) -> None:
        budgets = {0, self.max_budget}
        b = 4
        while b < self.max_budget:
            budgets.add(b)
            b *= 4
        # the largest first: where guesses hit, the fixed budget is what the first rounds measure
        self.arms = [Arm(b) for b in sorted(budgets, reverse=True)]

    def budget(self) -> int:
        untried = next((a for a in self.arms if a.rounds < TRIES), None)
        if untried is not None:
            return untried.budget
        top = max(a.rate for a in self.arms)
        # the smallest arm within MARGIN of the fastest, then the rest from the fastest down
        best = min((a for a in self.arms if a.rate >= top * (1 - MARGIN)), key=lambda a: a.budget)
        others = sorted((a for a in self.arms if a is not best), key=lambda a: a.rate, reverse=True)
        if others and self.rounds % REVISIT == REVISIT - 1:
            return others[0].budget
        return best.budget

    def record(self, budget: int, tokens: int, ms: float) -> None:
        """A round ran with `budget` (the arm it was given), emitted `tokens` in `ms`."""
        self.rounds += 1
        arm = next((a for a in self.arms if a.budget == budget), None)
        if arm is not None:  # a budget cut by the room left is no arm's measurement
            arm.record(tokens, ms)
