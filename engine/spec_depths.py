"""How far a chain drafter's guesses land, depth by depth: evidence every chain size shares.

A chain of d guesses is the first d guesses of a longer chain, so every chain round says something
of every chain, and one round whose first guess missed is no evidence that the longer chain is
worse than the shorter. The tree-size controller (engine/spec_control.py) reads its chain arms'
tokens a round from this estimate instead of from each arm's own rounds. Judged on its own rounds,
the biggest chain of MTP on an H100 (the 4-bit 9B-shaped pair) was tried once where its first
guess missed, emitted one token, and was not tried again for the rest of the request while the
four-guess chain beside it emitted five tokens a round (scripts/recordings/h100-9b-wide-4bit-mtp.json,
chat). Replayed over that recording, chains where guesses may hit, against the fixed budget: 0.866
-> 0.883 (fresh engine) and 0.830 -> 0.885 (remembering earlier requests' costs); where they miss
0.947 -> 0.954 and 0.958 -> 0.954; on the dev CPU's chain recording neutral (BENCHMARKS.md, issue
17, thirty-eighth session).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Each depth's acceptance is a moving average (DEPTH_DECAY of the history a round) of the rounds
# that reached it, with the depth above's estimate counted as one round more, starting from
# DEPTH_PRIOR at the first guess. The prior is pessimistic: before a depth is reached, the first
# guess is taken to land one time in five (0.5 lost 2.5 % where guesses miss; 0.1 lost 6 % of the
# H100's hits; 0.3 2.3 % of its misses).
DEPTH_DECAY = 0.8
DEPTH_PRIOR = 0.2


@dataclass
class DepthAcceptance:
    """A chain drafter's rounds, depth by depth, for chains of up to `depth` guesses: at each depth
    d (1 = the first guess), the moving averages of the rounds that reached it (their guess at d-1
    was right, or d is the first) and of those whose guess at d was right."""

    depth: int
    reached: list[float] = field(init=False)
    right: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.reached = [0.0] * self.depth
        self.right = [0.0] * self.depth

    def record(self, drafted: int, accepted: int) -> None:
        """A chain round of `drafted` guesses whose first `accepted` were right."""
        for d in range(min(accepted + 1, drafted, self.depth)):  # depth d + 1, reached
            self.reached[d] = DEPTH_DECAY * self.reached[d] + 1.0
            self.right[d] = DEPTH_DECAY * self.right[d] + float(d < accepted)

    def tokens(self, budget: int) -> float:
        """The tokens a round of a chain of `budget` guesses (at most `depth`) is expected to emit:
        its root's token and each guess's, the product of the acceptances down to it."""
        total, through, p = 1.0, 1.0, DEPTH_PRIOR
        for d in range(min(budget, self.depth)):
            p = (self.right[d] + p) / (self.reached[d] + 1.0)  # the depth above's estimate: one round
            through *= p
            total += through
        return total
