"""One round of the loop: draft -> verify -> accept -> commit, split at the host round trip.

`launch` drafts a tree and queues its verify (and, where nothing on the host is needed, the
choice of every node's token and the commit); `land` waits for the result, walks the tree to the
accepted path, commits it and lets the drafter observe it. Plain decoding is a round with a
one-node tree.

Every node's token is chosen on the device (engine/device_sampler.py: the argmax, or the seeded
draw), so only N ids reach the host, unless a request needs the logits there (logit bias,
penalties, logprobs: engine/sampler.py). Where round r and the next are both one-node trees and
the next needs nothing from the host (no logits there; no drafter, or one the controller gives no
budget and that catches up by itself), the loop launches round r+1 from round r's token while it
is still on the device, before landing round r: building the next graph overlaps the compute, as
mlx-lm's generate_step does. That is a property of the round (`can_pipeline`), not a second loop,
and it is what lets a controller that settles on plain rounds run as fast as plain decoding. The
controller's smallest tree (the root and one guess) is queued the same way behind a plain round
where the drafter guesses on the device (`GuessesAhead`). On a GPU a chain of top-1 guesses is
drafted on the device too (`ChainsOnDevice`): its verify is queued behind the draft, and the round
has one host round trip, its landing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np

from engine import blas, cpu_ext, device_sampler, forward, sampler
from engine.cache import LayerCache
from engine.config import SamplingParams, SpecConfig
from engine.device_penalties import DevicePenalties
from engine.drafters.base import (
    Chains,
    ChainsOnDevice,
    Drafter,
    Evidence,
    GuessesAhead,
    Hindsight,
    NoDrafter,
    Skips,
    skips,
)
from engine.logits_extras import token_logprobs, top_probabilities
from engine.models.base import CausalLM
from engine.sampler import TokenConstraint, position_uniform
from engine.spec_control import RoundCosts, SpecController
from engine.spec_evidence import ByEvidence
from engine.tree import DraftTree
from engine.types import Stats, TokenLogprob


@dataclass
class Sequence:
    """The sequence so far (prompt + emitted; its last token is the next root) and how many of
    its tokens the caches hold (at most all of them)."""

    tokens: list[int]
    covered: int
    prompt_len: int  # tokens[prompt_len:] is what this completion generated (penalties look at it)
    end: int = 1 << 62  # the most tokens it may reach: the prompt's and max_tokens, within the context

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class InFlight:
    """A launched round: its verify is queued on the device."""

    tree: DraftTree
    committed_len: int  # the root's position
    logits: mx.array  # [N, V], lazy
    choices: mx.array | None  # [N] int32 token per node, when chosen on the device
    committed: bool  # the commit was queued at launch (a one-node tree's root is always accepted)
    t_start: float
    draft_ms: float
    proposed: bool = True  # the drafter's propose ran for this round (False: it is told with skip)
    arm: int = -1  # the budget the controller chose for this round (-1: none to credit)
    evidence: int = 0  # the drafter's evidence class the round was chosen under (engine/spec_evidence.py)
    ahead_ms: float = 0.0  # a pipelined round: how long queueing it took, before the previous one landed
    restart: bool = False  # launched right after a tree landed (RESTART_ALONE_ON_CPU)
    tokens: mx.array | None = None  # [1, N] the tree's tokens, where they were still on the device at launch
    top: mx.array | None = None  # [N] the target's top-token probability by node, read on the device
    unstarted: list[mx.array] | None = None  # what `start` hands the device, where that waits (START_LATE_ON_CPU)


@dataclass(frozen=True)
class RoundResult:
    path: tuple[int, ...]  # accepted rows, root first
    tokens: tuple[int, ...]  # emitted: accepted drafts + the target's bonus token
    logprobs: list[TokenLogprob] | None


# module switch: False draws every node of a sampled tree in the verify's graph on the CPU too (the
# GPU's way; tests hold the two to the same tokens)
DRAW_VISITED_ON_CPU = True

# On the CPU, MLX's async_eval does not return until all but the last few dozen of the graph's
# tasks have run (a chain of 400 ops: it returned after 1022 of 1173 ms), so a pipelined round
# handed to the device before the previous one lands holds that one's token back for most of its
# own compute. In a run of plain rounds that only delays every token alike; but after a round
# that cannot be pipelined (a tree, the restart after it) two rounds' compute come between two
# tokens, and those gaps were the p99 of speculation where guesses miss. So when a drafter is on,
# the CPU builds the round after (the host's graph building still overlaps the previous round's
# compute) but starts it only once the previous round's token is out (`start`). Bundled target,
# dev CPU, 96 tokens sampled after 64 random ids, in-process A/Bs: pooled p99 gap 12.8-18.0 ms
# against 18.7-23.7 (ngram, MTP), at 1-6 % of tok/s (the host's landing no longer overlaps the
# compute). Plain decoding keeps starting at once (no gap to shorten), and so do GPUs, so that the
# device never waits for the host.
START_LATE_ON_CPU = True
# A late-started round's first layers are still handed over before the previous round lands.
# Started late as a whole, a round reached the device only after the previous one had finished
# and the host had landed it, emitted its token and walked the new round's graph (MLX's evaluation
# call), so the device idled between rounds (~1 ms a round on the dev CPU: a plain round in an
# engine with the MTP drafter cost 12.7 against 11.6 ms without one). The first layers' new state
# is a small graph: its evaluation call returns once the previous round's last tasks run, and the
# device goes on with those layers while the host lands the previous round. Bundled target, MTP, 96
# tokens sampled after 64 random ids, in-process A/Bs paired with plain decoding
# (scripts/bench_start_late.py --ahead-layers 0,2), three runs: 0.875-0.946x -> 0.907-0.986x of
# plain decoding (BENCHMARKS.md, issue 17, twelfth session).
START_AHEAD_LAYERS = 2
# ...and from one pipelined round to the next, AHEAD_RAMP layers more, until the whole round is
# started at once as plain decoding's are. A late start idles the worker between the layers handed
# ahead and the start, for the host's landing, its token's trip out and the next graph's first
# evaluation call: 2.5 % of plain decoding's speed at 64 prompt tokens after the forty-second
# session's faster steps (variant -sl0). Starting at once right after a tree puts the next round's
# compute before the token (a gap of two rounds, the p99 that START_LATE_ON_CPU is for); each
# layer more than the round before delays one token by that layer only, so the gaps grow by
# AHEAD_RAMP layers for a few rounds and the stretch after them runs unstarved. 0: no ramp.
AHEAD_RAMP = 2
# ...except behind the plain round right after a tree: that round was not queued ahead (its root and
# position came with the tree's landing), so it runs whole between two tokens, after the tree's
# commit, and the next round's graph and first layers queued before it lands came on top: on the
# dev CPU its gap was 5.1-6.0 ms against a 3.4 ms median, in every request where a tree was tried
# (the first round's one-guess try, the re-tries), and those gaps were the p99 where guesses miss.
# Landing it first splits that extra time over two gaps, the next round being queued ahead again.
RESTART_ALONE_ON_CPU = True
# Where the target's confidence (the controller's gate, engine/spec_gate.py) is read: on the
# device in the round's graph, so that only N floats travel with the N ids; on the CPU a tree's
# accepted rows on the host after the walk instead (its every row in the graph: ~0.75 ms for 17
# rows of 8,192 on the dev CPU), a one-node round's in the graph still (~0.05 ms; read on the host
# after the landing it cost ~0.12 ms, which the token waited for: NumPy's exponentials competed
# with the next round's start for the two cores). None: so; True / False: every round on the
# device / on the host (tests force either).
TOP_ON_DEVICE: bool | None = None
# Where a drafter's chain of top-1s is drafted on the device and the verify queued behind it
# (ChainsOnDevice), instead of the draft's top-k reaching the host before the tree is built: the
# round then has one host round trip instead of two, and the device runs the draft and the verify
# back to back while the host builds the verify's graph. None: on GPUs. The CPU drafts MTP chains
# depth by depth, its stop rule cutting them short, and its evaluation calls barely overlap the
# host: forced on there (bundled pair, greedy, two processes each way), MTP chains lost where guesses
# are short (math 0.70-0.74x plain decoding against 0.91-0.95x, code3 1.14-1.20x against
# 1.29-1.33x) and DFlash chains moved within noise (BENCHMARKS.md, issue 12, twenty-second
# session). True / False: everywhere / nowhere (tests force it on the CPU).
CHAIN_ON_DEVICE: bool | None = None


class Rounds:
    """The rounds of one generation against the target's caches."""

    def __init__(self, model: CausalLM, cache: list[LayerCache], seq: Sequence, params: SamplingParams,
                 seed: int, spec: SpecConfig, drafter: Drafter, stats: Stats,
                 constraint: TokenConstraint | None = None, costs: RoundCosts | None = None) -> None:
        self.model, self.cache, self.seq = model, cache, seq
        self.params, self.seed, self.spec, self.drafter, self.stats = params, seed, spec, drafter, stats
        self.constraint = constraint  # a grammar (params.grammar), walked along the accepted path
        # the repetition penalty also looks at the prompt's tokens
        self.prompt_seen = frozenset(seq.tokens[: seq.prompt_len]) if params.repetition_penalty != 1.0 \
            else frozenset()
        # every node's choice is made on the device, the request's bias and penalties applied there
        # too (engine/device_penalties.py), unless it asks for logprobs or a grammar masks tokens
        self.on_device = params.grammar is None and params.logprobs is None
        self.penalties: DevicePenalties | None = None  # made at the first round (its vocabulary)
        # On the CPU a sampled tree's nodes are drawn one by one as the accept walk visits them
        # (the same function on one row, so the same tokens as plain decoding's one-row draws):
        # drawing all 17 nodes of a tree cost 3.9 ms on the dev CPU against ~0.37 ms a node, and
        # the walk visits only the accepted path and one more node. Since a node is drawn at once on
        # the host (cpu_ext.draw_now, ~30 us with the default top-k); drawing every node in the
        # graph (variant -dv0) measured 0.90-0.93x for DDTree@16 rounds and 0.98-1.01x for chains
        # even before that (BENCHMARKS.md, issue 17, forty-fourth session). On a GPU all nodes are drawn
        # in the verify's graph, so that only N ids travel.
        self.draw_visited = DRAW_VISITED_ON_CPU and self.on_device and not params.greedy \
            and mx.default_device() == mx.cpu
        drafts = not isinstance(drafter, NoDrafter)
        self.controller: SpecController | ByEvidence | None = None
        if spec.adaptive and drafts:
            # a drafter that tells how good its next guesses are gets one controller per class
            # a chain drafter's trees stop at its depth: the controller predicts their times by rows
            depth = drafter.chain_depth(spec.max_depth) if isinstance(drafter, Chains) else None
            row_cap = None if depth is None else depth + 1
            # what trees cost in the engine's earlier requests (`costs`) predicts untried ones
            # a drafter with hindsight tells the controller which trees are worth a try (before any)
            told = isinstance(drafter, Hindsight)
            self.controller = ByEvidence(drafter, spec.budget, spec.max_stall, row_cap, costs, told) \
                if isinstance(drafter, Evidence) else \
                SpecController(spec.budget, spec.max_stall, row_cap, costs=costs, hindsight=told)
        # a drafter that tells what its trees would have done in plain rounds checks the controller's
        self.hindsight = drafter if isinstance(drafter, Hindsight) else None
        if self.hindsight is not None:
            self.hindsight.watch([a.budget for a in self.controller.arms[1:]] if self.controller else [],
                                 spec.max_depth)
        # the controller's gate reads the target's confidence at every emitted token
        # (engine/spec_gate.py); a drafter with hindsight has better evidence of its own
        self.confides = self.controller is not None and self.hindsight is None
        self.top_on_cpu = mx.default_device() == mx.cpu
        self.start_late = START_LATE_ON_CPU and drafts and mx.default_device() == mx.cpu
        self._tree_landed = False  # the last round landed was a tree (RESTART_ALONE_ON_CPU)
        self._ahead_layers = START_AHEAD_LAYERS  # layers the next pipelined round hands over early (AHEAD_RAMP)
        on_gpu = mx.default_device() != mx.cpu
        self.chains_on_device = self.on_device and isinstance(drafter, ChainsOnDevice) and (
            CHAIN_ON_DEVICE if CHAIN_ON_DEVICE is not None else on_gpu)
        self._last_landed = 0.0
        self._ahead_ms = 0.0  # spent since the last landing queueing the round after the one landing next
        self.last_round_ms = 0.0  # the last landed round's time as the controller is handed it

    def launch(self, room: int) -> InFlight:
        """Draft a tree of at most `room` emitted tokens from the last token and queue its verify."""
        t0 = time.perf_counter()
        # with a controller, an arm that fits the room left (one cut to fit credits no arm)
        evidence = self._evidence()
        arm = self._controller(evidence).fitting(room - 1) if self.controller else self.spec.budget
        budget = max(0, min(arm, room - 1))
        root = self.seq.tokens[-1]
        drafted = budget > 0 and not isinstance(self.drafter, NoDrafter)
        proposed = drafted or not skips(self.drafter)
        tree, tokens = DraftTree.single(root), None
        if drafted:
            blas.pace(host_busy=False)  # the host waits for the drafter's passes
            chain = cast(ChainsOnDevice, self.drafter).chain_on_device(root, budget, self.spec.max_depth) \
                if self.chains_on_device else None
            if chain is None:
                self._draws_from_root()
                tree = self.drafter.propose(root, budget, self.spec.max_depth)
            else:  # the tree's tokens reach the host when it lands (placeholders until then)
                tree = DraftTree.chain(root, [0] * chain.shape[0])
                tokens = mx.concatenate([mx.array([[root]], dtype=mx.int32), chain[None].astype(mx.int32)], axis=1)
        elif proposed:  # no budget, and no skip: a root-only proposal keeps the drafter's pairing
            self.drafter.propose(root, 0, self.spec.max_depth)
        t1 = time.perf_counter()
        flight = self._queue(tree, tokens, t0, (t1 - t0) * 1e3)
        flight.proposed, flight.arm, flight.evidence = proposed, arm if budget == arm else -1, evidence
        self._ahead_layers = START_AHEAD_LAYERS  # a round not queued ahead: the ramp starts again
        flight.restart = self._tree_landed
        blas.pace(host_busy=self.can_pipeline(flight))  # the host builds the next round meanwhile
        self.start(flight)
        return flight

    def can_pipeline(self, flight: InFlight) -> bool:
        """Whether the round after `flight` can be queued before `flight` lands: `flight` is a
        one-node round whose token is chosen on the device, and the next is one too (no drafter,
        or one the controller gives no budget and that catches up by itself through skip), or
        the smallest tree, the root and one guess, from a drafter that guesses on the device;
        on the CPU not behind the plain round right after a tree (RESTART_ALONE_ON_CPU)."""
        if not (self.on_device and flight.choices is not None and flight.tree.size == 1):
            return False
        if flight.restart and self.start_late and RESTART_ALONE_ON_CPU:
            return False
        if isinstance(self.drafter, NoDrafter):
            return True
        if self.controller is None or not skips(self.drafter):
            return False
        budget = self._budget_after()
        return budget == 0 or (budget == 1 and isinstance(self.drafter, GuessesAhead))

    def _draws_from_root(self) -> None:
        """Where the drafter guesses the target's seeded draws (MTPDrafter.sample_like): the request's
        sampling, and the position whose uniform the root row's draw uses (depth 1's guess), covered
        + 1 (the next round's committed length + 1, as _queue numbers its nodes)."""
        sample_like = getattr(self.drafter, "sample_like", None)
        if sample_like is not None:
            sample_like(self.params, self.seed, self.seq.covered + 1)

    def _budget_after(self) -> int:
        """The controller's budget for the round after the one-node round in flight, among the arms
        that fit the room left once that round's token is out."""
        assert self.controller is not None
        return self._controller(self._evidence()).fitting(self.seq.end - len(self.seq.tokens) - 2)

    def _evidence(self) -> int:
        """The drafter's evidence class for a round rooted at the last token it has seen: before a
        pipelined round, the token before its root (the root is still on the device), which stands
        for it (a match that held at one token mostly holds at the next)."""
        return self.controller.now() if isinstance(self.controller, ByEvidence) else 0

    def _controller(self, evidence: int) -> SpecController:
        assert self.controller is not None
        return self.controller.at(evidence) if isinstance(self.controller, ByEvidence) else self.controller

    def launch_after(self, flight: InFlight) -> InFlight:
        """Pipelined: the next round, rooted at `flight`'s token while still on the device.

        Where the controller asks for the one-guess tree, the drafter guesses on the device too
        and the two-node verify is queued behind `flight` like a plain round: the smallest tree
        is the controller's try and re-try where guesses miss, and drafting it after `flight`
        landed, then verifying without overlap, made it the p99 gap a streaming client saw (dev
        CPU, MTP: 17-24 ms against a 10 ms plain round; BENCHMARKS.md, issue 17). The round
        after it still waits for it to land (its root and position depend on the accept)."""
        assert self.can_pipeline(flight) and flight.choices is not None
        t0 = time.perf_counter()
        root = flight.choices[:1].reshape(1, 1)
        guess = None
        if self.controller is not None and self._budget_after() == 1:
            self._draws_from_root()
            guess = cast(GuessesAhead, self.drafter).guess_after(root)
        evidence = self._evidence()
        if guess is None:
            ahead = self._queue(DraftTree.single(0), root, t0, 0.0)
            ahead.proposed, ahead.arm = False, 0 if self.controller else -1
        else:
            tokens = mx.concatenate([root, guess.reshape(1, 1).astype(root.dtype)], axis=1)
            # the tree's tokens reach the host when it lands (placeholders until then)
            ahead = self._queue(DraftTree.chain(0, [0]), tokens, t0, (time.perf_counter() - t0) * 1e3)
            ahead.arm = 1
            ahead.unstarted = [ahead.choices if ahead.choices is not None else ahead.logits]
        ahead.evidence = evidence
        blas.pace(host_busy=self.can_pipeline(ahead))
        layers = self._ahead_layers if ahead.committed else 0
        if not ahead.committed:  # a tree: the ramp starts again after it
            self._ahead_layers = START_AHEAD_LAYERS
        elif AHEAD_RAMP and START_AHEAD_LAYERS:
            self._ahead_layers = min(self._ahead_layers + AHEAD_RAMP, len(self.cache))
        if not self.start_late or (AHEAD_RAMP and layers >= len(self.cache)):
            self.start(ahead)
        elif layers:  # a plain round: its layers' states are its own graph
            mx.async_eval(*(a for c in self.cache[:layers] for a in c.arrays()))
        ahead.ahead_ms = (time.perf_counter() - t0) * 1e3
        self._ahead_ms += ahead.ahead_ms
        return ahead

    def start(self, flight: InFlight) -> None:
        """Hand a queued round to the device (at once, except a pipelined round on the CPU with a
        drafter on: the loop starts it once the round before has landed and its token is out;
        START_LATE_ON_CPU)."""
        if flight.unstarted:
            mx.async_eval(*flight.unstarted)
        flight.unstarted = None

    def _queue(self, tree: DraftTree, tokens: mx.array | None, t0: float, draft_ms: float) -> InFlight:
        """Queue `tree`'s verify; tokens: its tokens [1, N] where they are still on the device (a
        pipelined root, a chain drafted on the device; `tree` holds placeholders for them)."""
        committed_len = self.seq.covered
        logits = forward.verify(self.model, self.cache, tree, committed_len, tokens=tokens)
        tree_tokens = tokens if tokens is not None and tree.size > 1 else None  # a one-node tree's root: no tree
        choices = top = None
        if self.on_device and not (self.draw_visited and tree.size > 1):
            positions = committed_len + tree.depths + 1  # the index each node's token will take
            uniforms = None if self.params.greedy else device_sampler.node_uniforms(self.seed, positions)
            wants_top = self.confides and (
                TOP_ON_DEVICE if TOP_ON_DEVICE is not None else tree.size == 1 or not self.top_on_cpu)
            # a one-node round's bias and penalties go with its choice (one CUDA launch for both)
            pen = self._penalties(logits.shape[-1]) if self.params.reweights and tree.size == 1 else None
            rows = logits if pen is not None else self._adjusted(logits, tree, tree_tokens)
            choices, top = device_sampler.choose_and_top(rows, self.params, uniforms, logits if wants_top else None,
                                                         penalties=pen)
        committed = tree.size == 1 and choices is not None
        flight = InFlight(tree, committed_len, logits, choices, committed, t0, draft_ms, tokens=tree_tokens, top=top)
        if choices is not None and committed:  # the root is accepted whatever the choice: commit now
            if self.penalties is not None:  # emitted whatever lands: the round queued behind sees it
                self.penalties.add(choices[:1])
            forward.commit(self.cache, [0], evaluate=False)
            self.seq.covered += 1
            flight.unstarted = [choices] if flight.top is None else [choices, flight.top]
        return flight

    def land(self, flight: InFlight) -> RoundResult:
        """Wait for the verify, walk to the accepted path, commit it, let the drafter observe."""
        self.start(flight)
        tree, params = flight.tree, self.params
        if flight.tokens is not None:  # a tree whose tokens were on the device: they reach the host now
            tree = flight.tree = DraftTree(tuple(np.array(flight.tokens)[0].tolist()), tree.parents)
        host_logits = None
        if flight.choices is not None:
            if flight.top is not None:
                mx.eval(flight.choices, flight.top)  # one wait for both
            choices = np.array(flight.choices)
            acc = sampler.accept_walk(tree, lambda node: int(choices[node]), params.stop_token_ids)
        elif self.draw_visited:  # each node the walk visits is drawn on its own
            acc = sampler.accept_walk(tree, lambda node: self._draw(flight, node), params.stop_token_ids)
        else:
            host_logits = np.array(flight.logits.astype(mx.float32))
            acc = sampler.accept(tree, host_logits, params, self.seed, flight.committed_len, self.seq.generated,
                                 self.constraint, self.prompt_seen)
        t2 = time.perf_counter()
        if not flight.committed:
            if self.penalties is not None:
                self.penalties.add(acc.tokens)
            # queued, not waited for: the next verify depends on the new state, so the commit runs on
            # the device while the host lets the drafter observe and drafts the next tree
            forward.commit(self.cache, acc.path, evaluate=False)
            mx.async_eval(forward.state_arrays(self.cache))
            self.seq.covered += len(acc.path)
        t3 = time.perf_counter()
        root = self.seq.tokens[-1]  # a pipelined tree's root was only on the device
        self.seq.tokens += acc.tokens
        self._tree_landed = tree.size > 1
        # counted as drafting: the drafter syncs its own state
        if flight.proposed:
            self.drafter.observe(list(acc.tokens))
        else:
            cast(Skips, self.drafter).skip(root, list(acc.tokens))
        logprobs = None
        if params.logprobs is not None and host_logits is not None:
            logprobs = token_logprobs(host_logits[list(acc.path)], list(acc.tokens), params.logprobs)
        self._count(flight, len(acc.path) - 1, len(acc.tokens), t2, t3)
        if self.confides:
            assert self.controller is not None
            self.controller.confide(self._top(flight, acc.path, host_logits).tolist())
        return RoundResult(acc.path, acc.tokens, logprobs)

    def _top(self, flight: InFlight, path: tuple[int, ...], host_logits: np.ndarray | None) -> np.ndarray:
        """The target's top-token probability at the rows of `path` (each emitted token's row)."""
        if flight.top is not None:
            return np.array(flight.top)[list(path)]
        if host_logits is None and cpu_ext.serves(cpu_ext.DRAW_NOW, flight.logits) and flight.logits.ndim == 2:
            # at once on the host, in the CPU's own operation (a few us against ~0.12 ms in NumPy)
            return np.array(cpu_ext.top_rows_now(flight.logits, list(path)))
        if host_logits is None:
            # the CPU's logits, read where they are (evaluated with the choices or the walk's
            # draws; an MLX read-out would queue behind the next round's first layers)
            host_logits = np.asarray(flight.logits) if flight.logits.dtype == mx.float32 else \
                np.array(flight.logits.astype(mx.float32))
        return top_probabilities(host_logits[list(path)])

    def _draw(self, flight: InFlight, node: int) -> int:
        """Node `node`'s token, drawn as a one-row device draw at its position's uniform: at once on
        the host where the CPU's operations serve it (cpu_ext.draw_now: the same bits as the graph
        below, without an evaluation of its own), else as a graph."""
        position = flight.committed_len + int(flight.tree.depths[node]) + 1
        params = self.params
        if cpu_ext.DRAW_NOW and device_sampler.one_operation(flight.logits, params):
            pen = self._penalties(flight.logits.shape[-1]) if params.reweights else None
            cols, extra = pen.path_counts(flight.tree, node) if pen is not None else ([], [])
            return cpu_ext.draw_now(
                flight.logits, node, None if pen is None else pen.counts, None if pen is None else pen.bias,
                None if pen is None else pen.in_prompt, cols, extra, params.frequency_penalty,
                params.presence_penalty, params.repetition_penalty, params.penalized, params.temperature,
                min(params.top_k, flight.logits.shape[-1]), params.top_p, params.min_p,
                position_uniform(self.seed, position))
        uniforms = device_sampler.node_uniforms(self.seed, [position])
        row = self._adjusted(flight.logits[node : node + 1], flight.tree, None, [node])
        return int(device_sampler.choose(row, params, uniforms)[0])

    def _penalties(self, vocab: int) -> DevicePenalties:
        """The request's bias and penalties on the device, made at their first use."""
        if self.penalties is None:
            self.penalties = DevicePenalties(self.params, vocab, self.seq.tokens[: self.seq.prompt_len],
                                             self.seq.generated)
        return self.penalties

    def _adjusted(self, logits: mx.array, tree: DraftTree, tokens: mx.array | None,
                  rows: list[int] | None = None) -> mx.array:
        """Tree rows' logits with the request's bias and penalties (as they are, without any)."""
        if not self.params.reweights:
            return logits
        return self._penalties(logits.shape[-1]).apply(logits, tree, tokens, rows)

    def _count(self, flight: InFlight, accepted: int, emitted: int, t2: float, t3: float) -> None:
        s = self.stats
        s.forward_passes += 1
        s.drafted += flight.tree.size - 1
        s.accepted += accepted
        for pos in range(accepted):
            if pos == len(s.accepted_per_pos):
                s.accepted_per_pos.append(0)
            s.accepted_per_pos[pos] += 1
        s.generated_tokens += emitted
        end = time.perf_counter()
        s.draft_ms += flight.draft_ms + (end - t3) * 1e3
        # from the end of drafting to the result on the host; pipelined rounds overlap, so a round's
        # wait starts no earlier than the previous landing: the phases add up to the wall time
        s.verify_ms += (t2 - max(flight.t_start + flight.draft_ms / 1e3, self._last_landed)) * 1e3
        s.commit_ms += (t3 - t2) * 1e3
        # a round's time, for the controller: from its launch, or from the previous landing where
        # it was queued before that (pipelined rounds overlap), plus the queueing of it that came
        # before, less the queueing of the next round that came inside. Charging the next round's
        # queueing to this one made the first plain round after a tree look twice as slow as it is
        # (on the CPU, queueing runs most of the compute): the controller then kept 1-node rounds
        # that asked for drafts the drafter did not have, which cannot be pipelined
        round_ms = self.last_round_ms = \
            (end - max(flight.t_start, self._last_landed)) * 1e3 - self._ahead_ms + flight.ahead_ms
        self._last_landed = end
        self._ahead_ms = 0.0
        if self.controller is not None:
            self._controller(flight.evidence).record(flight.arm, emitted, round_ms, flight.tree.size)
            if self.hindsight is not None:
                seen = self.hindsight.hindsight()
                if isinstance(self.controller, ByEvidence):
                    self.controller.observe(seen)
                else:
                    self.controller.observe([(b, n) for b, n, _ in seen])
