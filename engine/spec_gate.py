"""The target's confidence as free evidence for the tree-size controller (engine/spec_control.py).

Where the target is unsure of the next token a drafter rarely guesses it, and where it is sure one
often does. The engine reports the probability of the target's most likely token at every emitted
position (`confide`, engine/round.py); its moving average, a token at a time, is the confidence.
While it is at or below CONF_GATE the gate is shut: rounds are plain and the controller tries
nothing (re-tries, the climb and the trees' ageing wait). A drafter that is right where the target
is unsure (a draft model that is the target itself, on a model whose distribution is flat) lifts
the gate for the request. When the confidence first passes CONF_WAKE after a shut stretch, the
controller is woken: a tree is tried at once instead of at its next re-try. Drafters with hindsight
are not told the confidence (engine/round.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The confidence: a moving average, a token at a time (CONF_KEEP of the history), of the
# probability of the target's most likely token at each position emitted. At or below CONF_GATE no
# tree is tried or kept; above it, the controller's climb starts at the four-node tree. Measured on
# the bundled target (`scripts/controller_sim.py confidence FILE`, a fresh recording, ~700 positions
# a drafter): where the average over the positions before was below 0.5, a 16-node tree emitted
# 1.2-2.2 tokens a round; above 0.7, 3.0-4.8 (MTP, DFlash, draft model and n-gram alike). Replayed
# over three recordings against the controller without it (BENCHMARKS.md, issue 17, twentieth
# session), the geometric means where guesses may hit: MTP +3.0 / +1.6 / -1.3 %, DFlash +7.0 / +5.1
# / +1.9 %, the draft model +4.3 / +2.1 / +3.1 %; where they miss, MTP and the draft model gained or
# held, DFlash -2.3 to +0.9 %. The gate was chosen on the second recording (0.5-0.8 tried; 0.5 and
# 0.8 lost on one drafter each). It does not pay for a drafter with hindsight (the n-gram drafter's
# own evidence is better: -4 to -5 % where guesses hit), so the engine reports the confidence only
# to the others (engine/round.py).
CONF_KEEP = 0.7
CONF_GATE = 0.7
# After a shut stretch, the first time the average passes CONF_WAKE the controller tries the tree
# above its best arm at once (engine/spec_control.py `WAKE_COST` says where). Otherwise the trees
# come back only at the re-try spacing, counted in rounds: on chat (scripts/bench_spec.py) MTP's
# four guesses were right round after round in a sure stretch that the gated controller did not
# try. Waking as the gate opens (at 0.7) lost 1-5 % where guesses miss for every drafter
# (BENCHMARKS.md, issue 17, twentieth session).
CONF_WAKE = 0.85
# tries where the target was unsure, each accepting every guess, that lift the gate for good: as
# many as the controller's climb gives the smallest tree (one lucky guess is not enough)
LIFT_AFTER = 2


@dataclass
class ConfidenceGate:
    """The confidence of one request, and whether it shuts the trees out."""

    confidence: float | None = None  # None until reported
    # tree rounds chosen while the target was unsure (or, for the first round, unsure at its root),
    # and those of them that accepted every guess
    unsure_tries: int = 0
    unsure_hits: int = 0
    tried: tuple[int, int] | None = None  # the last round recorded, a tree's: (budget, tokens)
    woken: bool = True  # False from a shut round on till the confidence passes CONF_WAKE

    @property
    def reported(self) -> bool:
        return self.confidence is not None

    def record(self, budget: int, tokens: int) -> None:
        """A round the controller recorded (before its `confide`)."""
        self.tried = (budget, tokens) if budget > 0 else None

    def confide(self, probabilities: Sequence[float]) -> None:
        """After a round's record: the probability of the target's most likely token (its raw
        distribution) at each position the round emitted, in order."""
        if self.tried is not None and probabilities:
            budget, tokens = self.tried
            if (self.confidence if self.confidence is not None else probabilities[0]) <= CONF_GATE:
                self.unsure_tries += 1
                self.unsure_hits += tokens >= 1 + budget
            self.tried = None
        if self.shut():
            self.woken = False
        for p in probabilities:
            self.confidence = p if self.confidence is None else CONF_KEEP * self.confidence + (1 - CONF_KEEP) * p

    def _unsure(self) -> bool:
        return self.confidence is not None and self.confidence <= CONF_GATE

    def _right_where_unsure(self) -> bool:
        return 0 < self.unsure_tries and self.unsure_hits == self.unsure_tries

    def sure(self) -> bool:
        """Whether the confidence is reported and above CONF_GATE."""
        return self.confidence is not None and self.confidence > CONF_GATE

    def shut(self) -> bool:
        """Whether no tree is tried or kept now: the target is unsure, and the drafter's tries
        where it was unsure did not all accept every guess (there were none, or one missed)."""
        return self._unsure() and not self._right_where_unsure()

    def doubting(self) -> bool:
        """Whether the target is unsure and the drafter's tries there all accepted every guess but
        number fewer than LIFT_AFTER: then the smallest tree is tried again. From LIFT_AFTER such
        tries on the gate is lifted: the confidence does not predict this drafter."""
        return self._unsure() and self._right_where_unsure() and self.unsure_tries < LIFT_AFTER

    def wake_due(self) -> bool:
        """Whether the confidence has passed CONF_WAKE since the gate was last shut, and the
        controller has not acted on it yet (`wake`)."""
        return not self.woken and self.confidence is not None and self.confidence > CONF_WAKE

    def wake(self) -> None:
        self.woken = True
