"""One tree-size controller per class of the drafter's own evidence for its next guesses.

A drafter's guesses are not equally good from one round to the next, and some drafters can tell
which are which for free. The n-gram drafter's are continuations of earlier occurrences of the
context's last tokens: after a match of three or four tokens they are right about as often as
not, after a match of one or two rarely. Measured on the bundled target's greedy output
(`python scripts/bench_evidence.py orders`), the top continuation's accepted tokens a round:
on the 1.8k-token `long` prompt 0.22 / 0.32 after matches of 1 / 2 tokens against 1.08 / 1.23
after 3 / 4; on code 0.45-1.3 against 4.7-7.4. One controller over both kinds of round averages
them: where most rounds are weak it keeps trying trees that the few strong rounds pay for, and the
weak rounds' failed trees are the stalls a streaming client sees.

So each class gets its own SpecController (engine/spec_control.py), with its own arms, climb,
re-tries and hindsight: a round takes the budget of the controller of its class, and its outcome
(and each skipped round's hindsight, tagged with the class it had) goes back to that controller.
The weaker classes get at most WEAK_BUDGET guesses: their controllers choose between plain rounds
and the one-guess tree, whose failed tries cost ~1.3 plain rounds instead of the 2-3 of a 4- or
16-node tree. Where the drafter has hindsight, the weaker classes' controllers try the one-guess
tree only where the hindsight says it would have landed (engine/spec_control.py HINDSIGHT_FIRST);
the strongest class climbs as before. The accept rule is untouched, so output does not change.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.drafters.base import Evidence
from engine.spec_control import Arm, RoundCosts, SpecController

# The most guesses a round of a class below the strongest gets. The n-gram drafter, bundled target,
# dev CPU (`python scripts/bench_evidence.py ab`: 96 greedy tokens, 3 runs in one process, tok/s
# against plain decoding paired), geometric mean over bench_spec's long, code1-3, chat and math
# prompts, three runs: one controller 1.068 / 1.089 / 1.066, one per class with this cap 1.100 /
# 1.100 / 1.139; without the cap (every class up to the budget) 1.076 in one run. The long prompt
# is not fixed by it (0.89-0.96x plain either way; BENCHMARKS.md, issue 17, thirty-fourth session).
WEAK_BUDGET = 1
# Where the drafter has hindsight, the classes below the strongest wait for it to say a tree would
# go deep before trying one (engine/spec_control.py HINDSIGHT_FIRST, where the measurements are).
# False: they climb blind, as the strongest class does (scripts/variants.py "-ht0").
WEAK_WAIT = True


class ByEvidence:
    """SpecControllers by the evidence class of the round (0 .. drafter.classes - 1), each over
    the budgets up to `budget` (WEAK_BUDGET below the strongest class); `hindsight`: the drafter
    tells what its trees would have done, and the classes below the strongest try trees only where
    that says they would go deep."""

    def __init__(self, drafter: Evidence, budget: int, max_stall: float | None = None,
                 row_cap: int | None = None, costs: RoundCosts | None = None, hindsight: bool = False) -> None:
        self.drafter = drafter
        top = drafter.classes - 1
        # a tree's cost does not depend on the class of the round: one memory of it for all
        self.controllers = [SpecController(budget if c == top else min(budget, WEAK_BUDGET), max_stall, row_cap,
                                           costs=costs, hindsight=hindsight and WEAK_WAIT and c < top)
                            for c in range(drafter.classes)]

    @property
    def arms(self) -> list[Arm]:
        """The strongest class's arms, which hold every class's budgets (for the drafter's watched
        trees)."""
        return self.controllers[-1].arms

    def now(self) -> int:
        """The evidence class of a round rooted at the drafter's last token."""
        return self.drafter.evidence()

    def at(self, evidence: int) -> SpecController:
        return self.controllers[evidence]

    def observe(self, seen: Sequence[tuple[int, int, int]]) -> None:
        """Hindsight (budget, tokens, class), each handed to its class's controller."""
        for c, controller in enumerate(self.controllers):
            controller.observe([(b, n) for b, n, e in seen if e == c])

    def confide(self, probabilities: Sequence[float]) -> None:
        """The target's confidence is the text's, not a class's: every controller's gate reads it
        (the n-gram drafter has hindsight and is not told; a drafter with evidence and without
        hindsight would be)."""
        for controller in self.controllers:
            controller.confide(probabilities)
