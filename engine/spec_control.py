"""Sizing each round's draft tree so that speculation does not lose to plain decoding.

A bigger tree pays when the target accepts deep enough to cover its verify cost; where guesses
miss (random text, long context, sampling at a high temperature) every round pays for a tree it
throws away. The right size depends on the hardware, the model, the drafter and the text, and it
drifts during a generation, so it is measured, per request: each candidate budget ("arm", the
root alone among them) keeps an exponentially weighted estimate of the tokens a round emits and of
the milliseconds it takes, drafting included; each round takes the arm with the best tokens per
millisecond (prior art: vLLM's dynamic speculation, llama.cpp's draft p_min). Output is
unaffected: the accept rule does not look at the tree's size.

Trying costs more than the try itself. A tree round ends the pipelining of plain rounds (the
round after it cannot be queued before it lands), and a big tree's verify is a stall a streaming
client sees: measured on the dev CPU, a 17-node round and the restart after it were the p99
inter-token gaps where guesses miss (BENCHMARKS.md, issue 17). So the controller climbs: the
smallest tree is tried first (its two tries a plain round apart), a bigger one only once the one
below it accepts (a round emits at least CLIMB tokens) and where it could pay for its rows even if
it accepted more than the smaller trees predict (OPTIMISM), and the root alone after that. Then
each round takes the fastest arm, where a tree's tokens are its own rounds' with what the smaller
trees' rounds predict of it (SHARE; an untried tree is predicted, its time too, by its rows: GROW,
and tried when that makes it the fastest); later re-tries go to a neighbour of the best arm only,
and back off (twice as far apart each time) while they keep losing, further still where a losing
try costs much (RETRY_SHARE); a re-try upward that goes deep is followed at once by the tree above
it (a re-climb: RECLIMB), where it could pay.

The cheapest evidence is none at all: a drafter with hindsight (engine/drafters/base.py; the
n-gram drafter, whose lookup costs microseconds) tells, a round or a few after each plain round,
what each of the controller's trees would have emitted there, and that is counted as those trees'
tokens (`observe`). Where guesses turn right during plain rounds, the trees' estimates rise with it
and a tree is tried without waiting for a re-try; where they keep missing, nothing is spent to
learn it. A controller made with `hindsight` goes further: it tries a tree only where
the hindsight says it would go deep (HINDSIGHT_FIRST), so where guesses miss it never drafts.

One round is a noisy sample (a 5-node tree emits 1 to 5 tokens from one round to the next), and a
few samples decide. So the averages weigh an arm's first rounds alike (a plain moving average kept
four fifths of the first round after the second), and a tree is judged against plain rounds as if
it had also had PRIOR rounds that accepted nothing: one lucky round does not make a losing tree the
choice. And the text changes under a request: a tree's rounds age while other arms run (STALE), so
that rounds from a stretch where guesses missed do not outweigh fresh ones where they hit.
A chain drafter's arms share their evidence: a chain of d guesses is the first d guesses of a
longer one, so every chain round is read depth by depth into one estimate of how far guesses land
(engine/spec_depths.py), and each chain arm's tokens a round come from it.
scripts/controller_sim.py replays controllers over measured acceptance and round times, so that
such changes are compared without the machine's noise.

Free evidence for every drafter is the target's own confidence (engine/spec_gate.py, told through
`confide`): while it is low the gate is shut, rounds are plain and nothing is tried (re-tries, the
climb and the trees' ageing wait), unless trees were measured cheap here (GATE_COST); above it the
controller runs as above, its climb starting at the four-node tree; and when the confidence turns
high after a shut stretch, a tree is tried at once (where its rounds are cheap enough: WAKE_COST)
instead of at the next re-try.

A cap on the stall (`max_stall`, off by default): a round's tokens reach a streaming client
together, after the whole round, so a round that takes X plain rounds is a gap X times a plain
step's. With the cap, an arm whose rounds take longer than max_stall plain rounds is neither kept
nor re-tried, and a bigger tree is not tried where its predicted time (`ms`) says that it would
be: the tail stays near the cap (plain decoding's p99 times it) at
the price of the bigger trees' speed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.spec_depths import DepthAcceptance
from engine.spec_gate import ConfidenceGate

DECAY = 0.8  # weight of the history in each arm's estimates (a few rounds of memory)
# against plain rounds, a tree's tokens a round are read as if PRIOR rounds more had emitted one
# token each (accepted nothing): where guesses miss, one lucky round (3 tokens of a 5-node tree)
# would otherwise make the tree look faster than plain rounds for the several rounds it takes the
# average to come back down. Trees are ranked among themselves without it: a tree tried twice
# would lose to one run for many rounds, and it is re-tried only if it is a neighbour of the best
PRIOR = 1.0
# rounds of each arm before choosing; a tree whose first try accepts nothing is not tried again
# (each try where guesses miss costs a slow round and, after it, the restart of pipelined rounds)
TRIES = 2
REVISIT = 16  # rounds before the first re-try of a neighbouring arm
MAX_REVISIT = 128  # re-tries that keep losing back off up to this many rounds apart
# where plain rounds are best, a re-try that loses costs the time its round took beyond what plain
# rounds needed for the same tokens; such re-tries are spaced so that this stays within
# RETRY_SHARE of the time (and at least REVISIT rounds apart). A cheap try (MTP's one-guess tree,
# queued like a plain round, ~0.2 plain rounds lost) keeps REVISIT's spacing; one that costs a
# plain round more (DFlash's, whose block pass is ~5 ms of a ~11 ms step on the dev CPU) gets ~50
# rounds: with REVISIT alone its re-tries cost 1-2 % of the time where guesses miss, the margin
# issue 17's 0.95x of plain decoding is decided by.
RETRY_SHARE = 0.02
# tokens a round of the arm below must emit on average before a bigger tree is worth a try: where
# the small tree accepts nothing, a bigger one from the same guesses rarely does
CLIMB = 1.5
# ...and a bigger tree is tried (climbed to, re-climbed to, re-tried) only where it could beat the
# best rate measured below it: its tokens a round as the ln(1 + budget) model predicts them from the
# tree below (SHARE's model), with its excess over the root's token OPTIMISM times the model's, over
# its round's time (measured, else predicted: GROW). Measured on the bundled target, 4 -> 16 nodes
# emitted 1.2-1.9x the excess (the model: 1.76x); 1.25 covers 2.2x. Unless the tree below is
# saturated (its rounds emit SATURATED of its rows or more): where every guess lands, deeper ones
# may too, and the model says nothing of that (the n-gram drafter on output that loops: a 4-node
# tree emitting 5 tokens a round, a 16-node one 9). Why: on the 1.8k-token prompt of
# scripts/bench_spec.py the n-gram drafter's 4-node tree emitted 2.03-2.20 tokens (past CLIMB) in
# 9 ms; the 16-node trees it climbed to emitted 1.75 in 16-23 ms, 2.75-3.7 plain rounds each, the
# request's p99 gaps (BENCHMARKS.md, issue 17, thirty-fifth session)
OPTIMISM = 1.25
SATURATED = 0.7
# a bigger tree must beat a smaller one by this share of tokens per ms to be kept: round times on a
# busy machine jitter by about that much, and where every arm emits the same tokens (all guesses
# miss) only the jitter would otherwise decide, keeping trees that draft for nothing
MARGIN = 0.10
# the smallest tree: the root and one guess. Climbing starts there and re-tries of a losing
# drafter go there, so a try where guesses miss costs a plain step and one row more (on the dev
# CPU ~0.9 ms a row against ~11.5 ms a step), not a 5-node tree's four rows; a try is not
# pipelined, so its gap is a streaming client's tail. Being cheap, it always gets both its tries,
# and one guess right in them (1.2 tokens a round or more in the estimate) is enough to climb.
FIRST = 1
CLIMB_FIRST = 1.2
# what a smaller tree's rounds say of a bigger one's: a tree of b draft nodes emits, beyond the
# root's token, about ln(1 + b) / ln(1 + b') times what one of b' nodes does. Measured on the
# bundled target (scripts/controller_sim.py's first recording, 20 drafter x prompt pairs, misses
# and hits): 1 -> 4 nodes 1.9-3.3x (the model: 2.3x), 4 -> 16 nodes 1.2-1.9x (1.8x). Each tree's
# estimate is its own rounds' average with the model's prediction from the smaller trees counted as
# SHARE rounds more, fading as its own rounds come in (SHARE / (1 + rounds)): after the climb, an
# untried tree is tried when the smaller ones predict it is the fastest, a tree whose first round
# was unlucky is not judged on that round alone where the smaller ones accept, and its own rounds
# soon outweigh the model, which is a rough one (a strong drafter's big trees accept more than it
# predicts). Only upward: the small trees are the cheap ones to measure, and a big tree's rounds
# would inflate them.
SHARE = 2.0
# an untried tree's round time, predicted from the biggest tried tree below it by its rows (the
# root included; a chain stops at the drafter's depth, so a chain's budget of 16 verifies 7 rows at
# depth 6): the time grows by a factor per fourfold of rows fitted to the two biggest arms measured
# (plain rounds count, as one row), at least GROW (the least measured: one guess to four and four to
# sixteen, when the restart after a tree was the bulk of a small tree's time on the CPU) and at most
# MAX_GROW. A fixed GROW predicted a 16-node round of the n-gram drafter at 17.6 ms where it took
# 24.1 (1.6-2.0x a 4-node round at 60 and at 1.8k tokens of context on the dev CPU; BENCHMARKS.md,
# issue 17, thirty-fifth session); fitted, it predicts 15.9-21 ms there
GROW = 1.3
MAX_GROW = 4.0
# the weight of a tree's rounds shrinks by this much at every round of another arm: what a tree
# accepted forty rounds ago says little of the text now. Real engine, n-gram on code-edit of
# scripts/bench_spec.py: its 4- and 16-node trees were tried where guesses missed (1 token a round),
# and when the text turned predictable (the one-guess tree right every round, a re-climbed 4-node
# round emitting 4) those old rounds kept both out to the end of the request. Ageing lets the
# fresh rounds decide; it is kept mild (half-weight after ~14 rounds) because the model of what
# the smaller trees predict is rough, and an aged tree's estimate leans on it more
STALE = 0.95
# a tree whose own rounds' weight is below this is judged by its estimate with the prediction, not
# ruled out by its own rounds having accepted nothing (those may date from other text)
WMIN = 0.5
# a re-try of the tree above the best arm that emits this many tokens (or accepts its every guess:
# the one-guess tree's 2) is followed at once by a try of the tree above it, and so on up: a
# re-climb. Where plain rounds are best, re-tries go to the one-guess tree only, which seldom beats
# plain rounds by itself (on the dev CPU 2 tokens in ~12.7 ms against 1 in ~7.1), so a text that
# turned predictable after a miss-heavy start was decoded plain to its end (code3 of
# scripts/bench_spec.py, MTP: 1.02 tokens per forward against 3.84 with every round a 17-node tree)
RECLIMB = 3
# Woken after a shut stretch (engine/spec_gate.py), the controller tries the tree above its best
# arm at once, and climbs from it if it goes deep (a re-climb), where that tree's rounds take at
# most WAKE_COST plain rounds. Replayed over recordings 1 / 3 / 4 (BENCHMARKS.md, issue 17,
# twentieth session): MTP where guesses may hit 1.248 -> 1.289, 1.100 -> 1.134, 1.140 -> 1.194 (the
# fixed 16-node budget: 1.277, 1.099, 1.223), where they miss within 1.1 %; DFlash within 1 % both
# ways; the draft model's trees cost more than WAKE_COST: unchanged. Without the cost rule the draft
# model lost up to 2.7 % where guesses miss.
WAKE_COST = 2.5
# The confidence gate (engine/spec_gate.py) holds only where trees are costly: where the smallest tree
# above one guess was measured at less than GATE_COST plain rounds, an unsure target does not shut
# it out (the rates decide). The gate's evidence is the bundled target's on the dev CPU, where that
# tree costs 2.0-2.7 plain rounds (MTP). On the bundled model widened (scripts/widen_checkpoint.py,
# `test` shape), at 1.7-1.9, the gate had cost MTP 11 % against the fixed budget in the engine.
# Replayed, MTP where guesses may hit (recordings 1 / 3 / 4 / wide): 1.280 / 1.134 / 1.191 / 1.392
# without the cost rule, 1.291 / 1.134 / 1.183 / 1.450 with it; 1.6 kept less of the wide gain, 2.0
# lost 4 % where guesses miss on recording 4 (BENCHMARKS.md, issue 17, twenty-first session).
GATE_COST = 1.8


# Where the target is sure (its confidence above CONF_GATE, engine/spec_gate.py), a tree is kept
# when its rate beats plain rounds' as measured, without PRIOR's caution or MARGIN: those guard
# against a lucky round where guesses miss, and where the target is sure they mostly land. On the
# H200 a 16-node MTP round costs ~2.6 plain rounds and emits 1-7 tokens, 3.4 on average on code;
# one round of 1 or 2 brought the cautious estimate under plain rounds', and the re-tries then
# waited REVISIT rounds or more. Replayed (scripts/controller_sim.py replay, four start offsets,
# what earlier requests measured remembered), MTP where guesses may hit, against the fixed budget:
# H200 recording 0.888 -> 0.909, dev CPU recording 1.183 -> 1.220; where guesses miss 0.882 ->
# 0.883 and 0.860 -> 0.858 (BENCHMARKS.md, issue 17, thirty-seventh session).
SURE_AS_IS = True

# A controller made with `hindsight` (the drafter tells what its trees would have done in plain
# rounds) tries a tree only once that says it would go as deep as the climb asks (CLIMB_FIRST,
# CLIMB), over at least this many plain rounds' worth (weighted as Arm.count_tokens weighs them),
# and once: the try measures its time, the hindsight already told its tokens. Without it the climb
# tries the one-guess tree twice blind in every request, and re-tries it, and where guesses miss
# those are rounds that cannot be pipelined, each with the restart after it. The n-gram drafter's
# weak-evidence rounds (engine/spec_evidence.py) take it: bundled target, dev CPU, 128 tokens sampled
# after 4k random ids, 21 requests: 27 tree rounds and 87 plain rounds launched unpipelined against
# 71 and 235 (tok/s within the machine's noise, 0.975x against 0.979x of plain decoding, paired);
# at 64 ids 0.969x against 0.957x; tokens per forward on bench_spec's code, code-edit, chat, math and
# long prompts (greedy) the same or more. The strongest class keeps the blind climb: gated too, it
# climbed later where guesses hit (code 1.68 tokens per forward against 1.75, chat 1.51 against 1.64;
# BENCHMARKS.md, issue 17, fifty-eighth session).
HINDSIGHT_FIRST = 1.0

# the weight of a request's rounds in what the engine remembers of a tree's cost (RoundCosts)
REMEMBER = 0.3
# the climb starts at the biggest tree whose remembered round costs at most this many plain rounds
# more than the smallest tree it would otherwise start at (RoundCosts): where a bigger tree costs
# about what a small one does, its try where guesses miss loses about as much, and where they hit
# it is the one that pays. On the H200 (scripts/recordings/h200-9b-wide-4bit-mtp.json) a 16-node
# MTP round took 0.1-0.35 plain rounds more than a 4-node one (the draft and the restart cost more
# than the rows there), and a short answer (code2: ~8 rounds) spent half its rounds on the climb; on
# the dev CPU a 16-node tree costs 1.2-2.6 plain rounds more than a 4-node one, a 4-node one
# 0.5-0.7 more than one guess, and the climb starts where it did. Re-tries upward from plain rounds
# and the wake's try go up the same way: from plain rounds the neighbour above was the one-guess
# tree, ~2 plain rounds on the H200 for at most 2 tokens, which could not win there and whose
# losses spaced the re-tries out (replayed, MTP where guesses may hit, against the fixed budget:
# 0.868 -> 0.888 on the H200 recording; the dev CPU's within 0.3 %)
START_EXTRA = 0.5
# a remembered cost predicts an untried tree at no more than this many times the prediction by
# rows: one slow round (a kernel compiled on first use, a busy machine) must not make a tree look
# so costly that no later request tries it, and so never measures it again
MEMORY_CAP = 2.0


@dataclass
class RoundCosts:
    """What a tree round of each budget cost, in plain rounds of the same request, remembered
    across the requests of one engine and speculation setting (engine/generate.py keeps one per
    SpecConfig). An untried tree's time is predicted from it where it holds the tree's budget,
    before any model (`SpecController.ms`): a round's cost is the machine's, the model's and the
    drafter's, not the text's, and no model fitted to a request's small trees foresaw the big
    one's on the dev CPU. There, on the 1.8k-token prompt, the n-gram drafter's 1-, 4- and 16-node
    rounds took 6.2, 7.35 and 19-22.7 ms against 4.86 ms plain (the thirty-sixth session's trace):
    predicted from the smaller two, the 16-node round was 9.2 ms, so hindsight that raised the
    4-node tree's tokens made the climb try it, twice, in every request, each try a stall for the
    streaming client (the p99 gap)."""

    ratios: dict[int, float] = field(default_factory=dict)

    def remember(self, budget: int, ratio: float) -> None:
        old = self.ratios.get(budget)
        self.ratios[budget] = ratio if old is None else old + (ratio - old) * REMEMBER

    def ratio(self, budget: int) -> float | None:
        return self.ratios.get(budget)


@dataclass
class Arm:
    budget: int  # draft nodes besides the root; 0 = plain decoding
    tokens: float = 0.0  # moving average of tokens emitted per round (a chain's: from `depths`)
    ms: float = 0.0  # moving average of a round's wall time, drafting included
    last_ms: float = 0.0  # the last round's wall time
    rows: float = 0.0  # moving average of a round's tree rows, the root included (plain: 1)
    rounds: int = 0
    hint: float = 0.0  # what the drafter's hindsight says a round of it emits (SpecController.hindsight)
    hint_weight: float = 0.0
    # the rounds behind the averages, each discounted by DECAY for every round of this arm since
    # and by STALE for every round of another arm (the controller ages it)
    weight: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0

    def record(self, tokens: int, ms: float, rows: int) -> None:
        self.count_tokens(tokens)
        self.ms += (ms - self.ms) / self.weight
        self.rows += (rows - self.rows) / self.weight
        self.last_ms = ms
        self.rounds += 1

    def count_tokens(self, tokens: float) -> None:
        """One round's tokens into the average (a round of its own, or the drafter's hindsight of
        one, which has no time). Averages weighted DECAY^age, divided by their total weight: the
        first rounds weigh alike (a plain EWMA would keep 0.8 of the first round after the second),
        later ones converge to an EWMA of 1 - DECAY."""
        self.weight = DECAY * self.weight + 1.0
        self.tokens += (tokens - self.tokens) / self.weight


@dataclass
class SpecController:
    """Chooses the budget of each round among 0, FIRST, powers of four below `max_budget`, and it."""

    max_budget: int
    max_stall: float | None = None  # the longest round kept, in plain rounds (None: no cap)
    # the most rows a tree of the drafter has, the root included (a chain builder's depth + 1);
    # None: a tree fills its budget
    row_cap: int | None = None
    costs: RoundCosts | None = None  # what trees cost in earlier requests (None: nothing remembered)
    # the drafter tells what its trees would have done in plain rounds (`observe`): a tree is tried
    # only where that says it would go deep (HINDSIGHT_FIRST), and once, to measure its time
    hindsight: bool = False
    arms: list[Arm] = field(default_factory=list)  # ascending budgets, arms[0] = the root alone
    # a chain drafter's (row_cap set) acceptance depth by depth, which its arms' tokens are read from
    depths: DepthAcceptance | None = None
    rounds: int = 0
    interval: int = REVISIT  # rounds between re-tries, doubled while they lose
    next_revisit: int = 0  # the round of the next re-try (0: climbing, none scheduled yet)
    revisit_side: int = 1  # +1: the neighbour above the best arm, -1: below (alternating)
    last: int = 0  # the budget of the last round recorded (0 before the first)
    reclimb: int = 0  # the budget of a re-climb's next try (0: none under way)
    # the re-climb's try was set by the wake (`_wake`): the target's confidence asks for it whatever
    # the rounds before the shut stretch said, so it is not checked against them (`_promising`)
    woken_climb: bool = False
    gate: ConfidenceGate = field(default_factory=ConfidenceGate)  # the target's confidence
    # the answer of `budget` until the next record, observe or confide (the only calls that change
    # what it depends on): a round asks it three to four times (engine/round.py), and on the dev
    # CPU each answer was ~15 µs of Python that the host took from the two cores computing the
    # round in flight (~1 % of a plain round, more for the n-gram drafter's hindsight controller)
    _budget: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        budgets = {0, min(FIRST, self.max_budget), self.max_budget}
        b = 4
        while b < self.max_budget:
            budgets.add(b)
            b *= 4
        self.arms = [Arm(b) for b in sorted(budgets)]
        if self.row_cap is not None:
            self.depths = DepthAcceptance(self.row_cap - 1)

    @property
    def confidence(self) -> float | None:
        return self.gate.confidence

    def confide(self, probabilities: Sequence[float]) -> None:
        """After a round's record: the probability of the target's most likely token (its raw
        distribution) at each position the round emitted, in order."""
        self._budget = None
        self.gate.confide(probabilities)
        if self.gate.wake_due() and self._climbing() is None and not self.reclimb:
            self.gate.wake()
            self._wake()

    def gated(self) -> bool:
        """Whether the confidence gate shuts the trees out now: the target is unsure (and the
        drafter has not lifted the gate), and trees are costly here (GATE_COST; until a tree has
        been measured they count as costly)."""
        if not self.gate.shut():
            return False
        plain, tree = self.arms[0], self.arms[min(2, len(self.arms) - 1)]
        return not (plain.rounds and tree.rounds and tree.ms < GATE_COST * plain.ms)

    def _wake(self) -> None:
        """The target turned sure after a stretch where it was not: a re-climb from the tree above
        the best arm (the four-node tree above plain rounds), unless that tree's rounds cost (or are
        predicted to cost) more than WAKE_COST plain rounds or the stall cap rules it out."""
        best = self.best()
        # from plain rounds: the four-node tree, or a bigger one that costs little more (`_climb_start`)
        up = self._up(best) if best.budget else self.arms[self._climb_start(min(2, len(self.arms) - 1))].budget
        arm = self._arm(up) if up else None
        plain = self.arms[0]
        # the tree's cost measured, else predicted (an untried tree may be predicted from the
        # one-guess tree's rounds)
        cost = 0.0 if arm is None else self.ms(arm)
        if arm is not None and self._allowed(arm) and (cost <= 0.0 or not plain.rounds
                                                       or cost <= WAKE_COST * plain.ms):
            self.reclimb, self.woken_climb = up, True

    def tokens(self, arm: Arm) -> tuple[float, float]:
        """A tree's tokens a round and the weight behind it: its own rounds' average, with what
        the smaller trees' rounds predict of it (the ln(1 + budget) model, weighted by their
        weights) counted as up to SHARE / (1 + its rounds) rounds more."""
        scale = math.log1p(arm.budget)
        predicted, weight = 0.0, 0.0
        for other in self.arms[1:]:
            if other.budget < arm.budget and other.rounds:
                predicted += (1.0 + (other.tokens - 1.0) * scale / math.log1p(other.budget)) * other.weight
                weight += other.weight
        if weight == 0.0:
            return arm.tokens, arm.weight
        share = min(weight, SHARE / (1 + arm.rounds))
        return (arm.tokens * arm.weight + predicted / weight * share) / (arm.weight + share), arm.weight + share

    def rows(self, arm: Arm) -> float:
        """A round's tree rows, the root included: measured, else predicted from the biggest tried
        tree below (the share of its budget that it filled), up to row_cap."""
        if arm.rounds:
            return arm.rows
        if arm.budget == 0:
            return 1.0
        below = [a for a in self.arms[1:] if a.rounds and a.budget < arm.budget]
        fill = min(1.0, (below[-1].rows - 1.0) / below[-1].budget) if below else 1.0
        rows = 1.0 + fill * arm.budget
        return rows if self.row_cap is None else min(rows, float(self.row_cap))

    def ms(self, arm: Arm) -> float:
        """A round's time: measured, else what it cost earlier requests (RoundCosts) in this one's
        plain rounds, at most MEMORY_CAP times what the smaller trees predict by rows (GROW), else
        that prediction; 0 where none is known."""
        if arm.rounds:
            return arm.ms
        ratio = None if self.costs is None else self.costs.ratio(arm.budget)
        scale = None if ratio is None else self._plain_scale()
        model = self._by_rows(arm)
        if ratio is None or scale is None:
            return model
        remembered = ratio * scale
        return remembered if model <= 0.0 else min(remembered, MEMORY_CAP * model)

    def _plain_scale(self) -> float | None:
        """This request's plain round in ms, to scale remembered costs by: measured (`plain_ms`),
        else a tree's time measured here over its remembered cost (a climb that starts above the
        smallest tree runs its plain rounds last); None where neither is known."""
        if self.arms[0].rounds:
            return self.plain_ms()
        assert self.costs is not None
        for arm in reversed(self.arms[1:]):
            ratio = self.costs.ratio(arm.budget) if arm.rounds else None
            if ratio:
                return arm.ms / ratio
        return None

    def _by_rows(self, arm: Arm) -> float:
        """An untried tree's time predicted from the biggest tried tree below by its rows (GROW);
        0 where no tree below was tried."""
        measured = [a for a in self.arms if a.rounds and a.budget < arm.budget]
        if not measured or not measured[-1].budget:
            return 0.0
        top = measured[-1]
        grow = GROW
        if len(measured) > 1:
            ref = measured[-2]
            if top.rows > ref.rows and 0.0 < ref.ms < top.ms:
                fitted = (top.ms / ref.ms) ** (math.log(4.0) / math.log(top.rows / ref.rows))
                grow = min(MAX_GROW, max(GROW, fitted))
        return top.ms * grow ** math.log(max(self.rows(arm), 1.0) / top.rows, 4)

    def _promising(self, arm: Arm) -> bool:
        """Whether a try of `arm` could beat the best rate measured below it (OPTIMISM): its
        tokens a round as generously as the model predicts them from the biggest tried tree below,
        over its round's time (its own tokens where they are more); or that tree is saturated
        (SATURATED). A tree with nothing measured below it is promising."""
        below = [a for a in self.arms[1:] if a.rounds and a.budget < arm.budget]
        if not below:
            return True
        b = below[-1]
        ms = self.ms(arm)
        if b.tokens >= SATURATED * b.rows or ms <= 0.0 or b.ms <= 0.0:
            return True
        excess = (b.tokens - 1.0) * OPTIMISM * math.log1p(arm.budget) / math.log1p(b.budget)
        tokens = max(min(self.rows(arm), 1.0 + max(0.0, excess)), arm.tokens if arm.rounds else 0.0)
        return tokens / ms > max(b.rate, self.plain_rate())

    def rate(self, arm: Arm, cautious: bool = False) -> float:
        """A tree's tokens per ms (`cautious`: with its tokens shrunk toward one a round by PRIOR
        rounds' worth, as it is judged against plain rounds; an untried tree is not shrunk: it
        is judged on the others' rounds, and its try is how it is measured)."""
        ms = self.ms(arm)
        if ms <= 0:
            return 0.0
        tokens, weight = self.tokens(arm)
        if cautious and arm.rounds:
            tokens = (tokens * weight + PRIOR) / (weight + PRIOR)
        return tokens / ms

    def plain_rate(self) -> float:
        """Plain rounds' tokens per ms, their time taken as no more than any tree's round: a tree's
        round runs the plain round's row and more, so a plain time above a tree's is stale. Plain
        rounds are measured on their own rounds only, so where a tree is chosen its time stays
        fresh while the plain time dates from the request's slower first rounds: 9.1 ms against
        5.9 later, on the dev CPU at 1.8k tokens of context, and a one-guess tree that emitted 1.02
        tokens in 7.5 ms looked faster and ran 35 rounds in a row (BENCHMARKS.md, issue 17)."""
        plain = self.arms[0]
        return plain.tokens / self.plain_ms() if plain.rounds else 0.0

    def plain_ms(self) -> float:
        """A plain round's time, taken as no more than any tree's round (`plain_rate`)."""
        return min([self.arms[0].ms, *(a.ms for a in self.arms[1:] if a.rounds)])

    def _allowed(self, arm: Arm) -> bool:
        """Whether `arm`'s rounds stay within max_stall plain rounds: measured where it ran, else
        predicted as every untried tree is (`ms`). Before a plain round was measured, only the
        smallest tree is allowed (it is tried first)."""
        if self.max_stall is None or arm.budget == 0:
            return True
        plain = self.arms[0]
        if not plain.rounds:
            return arm.budget <= FIRST
        limit = self.max_stall * plain.ms
        if arm.rounds:
            # the last round as well as the average: one slow round (a first use, a busy machine)
            # weighs on the average for several rounds, and an arm ruled out is not re-tried
            return min(arm.ms, arm.last_ms) <= limit
        return self.ms(arm) <= limit  # (0: nothing measured below it to predict from)

    def _climbing(self) -> Arm | None:
        """The arm still owed its tries: the smallest tree first (or a bigger one that costs
        little more: `_climb_start`), each bigger one only while the one below accepts (and the
        stall cap allows it), then the root alone. A tree bigger than
        one guess that accepted nothing on its first try is owed no second one. The climb goes by
        acceptance, not by the predicted rate: a drafter that guesses right but drafts each depth
        at a cost (a draft model) has bigger trees whose tokens and times the ln model gets wrong,
        and only trying them measures them (a draft model that is the target itself: 1.05 tokens
        per forward when the climb went by the prediction, tests/server/test_spec_edges.py). But a
        tree that could not win even as generously predicted (OPTIMISM) is not tried, nor tried a
        second time once its first try says so: the tree below accepts, but not enough to pay for
        the bigger one's rows (a saturated tree below always is; that draft model's are)."""
        # with the target's confidence reported, the climb starts above the smallest tree: it runs
        # only where the target is confident, where the one-guess tree's tries are a detour; and
        # higher still where earlier requests measured the bigger trees at little more (START_EXTRA)
        start = self._climb_start(1 + int(self.gate.reported and len(self.arms) > 2))
        for arm in self.arms[start:]:
            if self.hindsight:
                if not self._allowed(arm) or not self._hinted(arm) \
                        or arm.budget != FIRST and not self._promising(arm):
                    break
                if not arm.rounds:
                    return arm
                continue
            # the smallest tree gets both its tries whatever the first cost (one slow round, e.g.
            # the first of a request, must not rule speculation out); a bigger one is judged on one
            if not self._allowed(arm) and not (arm.budget == FIRST and arm.rounds < TRIES):
                break
            if arm.budget != FIRST and not self._promising(arm):  # its second try too, once it is measured
                break
            if arm.rounds < TRIES and not (arm.rounds and arm.tokens <= 1.0 and arm.budget != FIRST):
                return arm
            if arm.tokens < (CLIMB_FIRST if arm.budget == FIRST else CLIMB):
                break
        return self.arms[0] if self.arms[0].rounds < TRIES else None

    def _hinted(self, arm: Arm) -> bool:
        """With hindsight: whether it says that `arm`'s rounds would go as deep as the climb asks of
        a tree (CLIMB_FIRST, CLIMB), over at least HINDSIGHT_FIRST rounds' worth of it."""
        return arm.hint_weight >= HINDSIGHT_FIRST and arm.hint >= (CLIMB_FIRST if arm.budget == FIRST else CLIMB)

    def _climb_start(self, first: int) -> int:
        """The index of the arm the climb starts at: `first`, or the biggest allowed arm above it
        whose remembered cost is at most START_EXTRA plain rounds more than `first`'s (both
        remembered: RoundCosts)."""
        costs = self.costs
        base = None if costs is None else costs.ratio(self.arms[first].budget)
        if costs is None or base is None:
            return first
        start = first
        for i in range(first + 1, len(self.arms)):
            ratio = costs.ratio(self.arms[i].budget)
            if ratio is not None and ratio <= base + START_EXTRA and self._allowed(self.arms[i]):
                start = i
        return start

    def best(self, limit: int | None = None) -> Arm:
        """Plain rounds, unless a tree's cautious rate beats theirs by more than MARGIN (where the
        target is sure, its rate as it is: SURE_AS_IS); then the
        smallest of those trees within MARGIN of the fastest (of those of at most `limit` guesses,
        where given). Trees whose time is neither measured
        nor predictable are not candidates, nor, once the root was tried, is a tree whose recent own
        rounds emit no more than the root alone (it accepts nothing, whatever the smaller trees
        predict; WMIN): it costs more for the same tokens, and only a slow outlier among the root's
        rounds could make it look faster (one did in a test, and trees stayed on until the next
        re-try)."""
        plain = self.arms[0]
        trees = [a for a in self.arms[1:] if self.ms(a) > 0 and self._allowed(a)
                 and (limit is None or a.budget <= limit)]
        if plain.rounds:
            # where the target is sure (engine/spec_gate.py), a tree is judged on its rates as they
            # are (SURE_AS_IS)
            sure = SURE_AS_IS and self.gate.sure()
            trees = [a for a in trees if (a.tokens if a.weight >= WMIN else self.tokens(a)[0]) > 1.0
                     and (self.rate(a) > self.plain_rate() if sure
                          else self.rate(a, cautious=True) * (1 - MARGIN) > self.plain_rate())]
        if not trees:
            return plain
        top = max(self.rate(a) for a in trees)
        return min((a for a in trees if self.rate(a) >= top * (1 - MARGIN)), key=lambda a: a.budget)

    def _due(self) -> bool:
        """Whether this round re-tries a neighbour (scheduled once the climb is over)."""
        return self.next_revisit > 0 and self.rounds >= self.next_revisit

    def budget(self) -> int:
        """The budget of the next round (pure: asking twice without a record gives the same answer,
        kept from the first time)."""
        if self._budget is None:
            self._budget = self._choose()
        return self._budget

    def fitting(self, limit: int) -> int:
        """The next round's budget where at most `limit` guesses fit (the last tokens a request may
        emit): budget() where it fits, else best() among the arms that fit. Why: a tree
        cut to fit is no arm's measurement, so the controller never saw that the trees it kept
        cutting lost, and a re-climb it had under way stayed under way: on the dev CPU, the n-gram
        drafter on a 1.8k-token prompt ended each 96-token request with 11 cut 16-node trees at
        1.6-2.3x a plain round's time for 1.45 tokens each."""
        want = self.budget()
        return want if want <= limit else self.best(limit).budget

    def _choose(self) -> int:
        if self.gated():
            return 0
        if self.gate.doubting():  # the smallest tree again, a plain round after the last try
            return 0 if self.last != 0 else self.arms[1].budget
        climbing = self._climbing()
        if climbing is not None:
            # a plain round before the smallest tree's second try: a one-guess round after a plain
            # one is queued before that one lands where the drafter guesses on the device
            # (engine/round.py), while one right after a tree waits for it and drafts on the host
            if climbing.budget == FIRST and climbing.rounds and self.last != 0:
                return 0
            return climbing.budget
        if self.reclimb and (self.woken_climb or self._promising(self._arm(self.reclimb))):
            # (one set while it was promising may not be any more: the rounds since said otherwise)
            return self.reclimb
        best = self.best()
        return self._neighbour(best).budget if self._due() else best.budget

    def _above(self, arm: Arm, tokens: int) -> int:
        """The budget a re-climb tries after a round of `arm` that emitted `tokens`: the tree above
        it, where the round went deep enough (RECLIMB) and the stall cap allows it; else 0."""
        return self._up(arm) if tokens >= min(1 + arm.budget, RECLIMB) else 0

    def _arm(self, budget: int) -> Arm:
        return next(a for a in self.arms if a.budget == budget)

    def _up(self, arm: Arm) -> int:
        """The budget of the tree above `arm` where the stall cap allows it and it could win
        (`_promising`); else 0."""
        i = self.arms.index(arm)
        if i + 1 == len(self.arms) or not self._allowed(self.arms[i + 1]) or not self._promising(self.arms[i + 1]):
            return 0
        return self.arms[i + 1].budget

    def _neighbour(self, best: Arm) -> Arm:
        """The arm to re-try beside `best`: this time's side, else the other one, else `best`
        itself (where the stall cap rules out both). The tree above is re-tried only where it
        could win (`_promising`): its re-try is a stall for text it has no chance on."""
        i = self.arms.index(best)
        side = self.revisit_side if 0 < i < len(self.arms) - 1 else (1 if i == 0 else -1)
        # up from plain rounds, first as the climb starts (START_EXTRA), then the one-guess tree
        for j in ((self._climb_start(1), 1) if i == 0 and len(self.arms) > 1 else (i + side, i - side)):
            if 0 <= j < len(self.arms) and self._allowed(self.arms[j]) \
                    and (j < i or self._promising(self.arms[j]) and (not self.hindsight or self._hinted(self.arms[j]))):
                return self.arms[j]
        return best

    def observe(self, seen: Sequence[tuple[int, int]]) -> None:
        """Hindsight from the drafter (engine/drafters/base.py `Hindsight`): for rounds without a
        tree, (budget, the tokens a tree of that budget would have emitted). Counted as rounds of
        that tree's tokens (not of its time), once it has a measured time: a drafter whose guesses
        turn right during plain rounds makes the trees climb without a re-try."""
        if not seen:
            return
        self._budget = None
        pairs = [(arm, tokens) for budget, tokens in seen for arm in self.arms if arm.budget == budget and budget]
        for arm, tokens in pairs:
            arm.hint_weight = DECAY * arm.hint_weight + 1.0
            arm.hint += (tokens - arm.hint) / arm.hint_weight
        counted = [(arm, tokens) for arm, tokens in pairs if arm.rounds]
        if not counted:  # only untried trees were told: best() cannot change (it reads no hints)
            return
        before = self.best() if self._climbing() is None else None
        for arm, tokens in counted:
            arm.count_tokens(tokens)
        after = self.best()
        if before is not None and after is not before:
            # the choice changed: re-tries from there at the first spacing (those that lost before
            # spaced them out for the text they lost on), and, as after a re-try that went deep,
            # the tree above is tried at once: its own rounds may date from the text the guesses
            # missed on
            self.interval = REVISIT
            self.next_revisit = self.rounds + REVISIT
            if after.budget > before.budget:
                self.reclimb, self.woken_climb = self._up(after), False

    def record(self, budget: int, tokens: int, ms: float, rows: int | None = None) -> None:
        """A round ran with `budget` (the arm it was given), emitted `tokens` in `ms` from a tree
        of `rows` rows, the root included (None: the budget's, up to row_cap)."""
        self._budget = None
        arm = next((a for a in self.arms if a.budget == budget), None)
        if rows is None:
            rows = budget + 1 if self.row_cap is None else min(budget + 1, self.row_cap)
        if budget == 0 and self.gated():
            # a gated round times plain rounds and is nothing else: the re-tries' clock (pushed on
            # with the rounds), the trees' ageing and the climb wait for text the target is sure of
            self.arms[0].record(tokens, ms, rows)
            self.rounds += 1
            self.next_revisit += bool(self.next_revisit)
            self.last = 0
            return
        self.gate.record(budget, tokens)
        best_before = self.best() if self._due() and arm is not None else None
        self.rounds += 1
        self.last = budget
        if arm is None:  # a budget cut by the room left is no arm's measurement
            return
        arm.record(tokens, ms, rows)
        if self.costs is not None and budget and self.arms[0].rounds:
            self.costs.remember(budget, ms / self.plain_ms())
        for other in self.arms[1:]:  # the other trees' rounds age (STALE)
            if other is not arm:
                other.weight *= STALE
        if self.depths is not None and budget:
            # a chain: its round, depth by depth, is every chain's evidence (engine/spec_depths.py)
            self.depths.record(rows - 1, tokens - 1)
            for tried in self.arms[1:]:
                if tried.rounds:
                    tried.tokens = self.depths.tokens(tried.budget)
        if self.reclimb and budget == self.reclimb:  # a re-climb's try: up again while it goes deep
            self.reclimb, self.woken_climb = self._above(arm, tokens), False
            if self.best() is arm:  # it changed the choice: re-tries from there at the first spacing
                self.interval = REVISIT
                self.next_revisit = self.rounds + REVISIT
        elif best_before is not None and arm is not best_before:  # a re-try was recorded
            self.revisit_side = -self.revisit_side
            # a re-try that changed the choice resets the spacing; one that lost widens it
            self.interval = REVISIT if self.best() is not best_before else min(2 * self.interval, MAX_REVISIT)
            self.next_revisit = self.rounds + self._spacing()
            if arm.budget > best_before.budget:
                self.reclimb, self.woken_climb = self._above(arm, tokens), False
        elif not self.next_revisit and self._climbing() is None:  # the climb just ended
            self.next_revisit = self.rounds + self._spacing()
        elif best_before is not None and self._neighbour(best_before) is best_before:
            # a re-try was due and no neighbour was worth one (the stall cap rules both out, or the
            # hindsight says no tree above would go deep): look again a spacing later, not every
            # round (each look asks best() anew). Replayed over every recording: the same choices
            self.next_revisit = self.rounds + self.interval

    def _spacing(self) -> int:
        """Rounds until the next re-try: the back-off interval, or, where plain rounds are best,
        more (up to MAX_REVISIT) if the tree it will try lost more than RETRY_SHARE of that many
        plain rounds when it last ran."""
        best = self.best()
        arm = self._neighbour(best)
        # only while plain rounds are best: among trees a re-try is how a better tree is found
        # again after the text changes, and one slow round of it must not put that off
        if best.budget != 0 or arm is best or not arm.rounds or best.rate <= 0.0:
            return self.interval
        lost = max(0.0, arm.ms - arm.tokens / best.rate)
        return max(self.interval, min(MAX_REVISIT, math.ceil(lost / (RETRY_SHARE * best.ms))))
