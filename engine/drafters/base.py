"""The drafter protocol: propose a draft tree from the committed context, then observe
what the target accepted; or, for a round that runs without a tree (the controller chose plain
decoding, or one token of room was left), skip it. Plain decoding is the drafter that proposes
only the root."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from engine.feature_cache import FeatureCache, FeatureTaps
from engine.tree import DraftTree

# (model, fresh caches, prompt ids) -> tokens restored from a prefix cache: a draft model's prefill
Fill = Callable[[Any, list[Any], Sequence[int]], int]


class Drafter(Protocol):
    def begin(self, prompt_ids: list[int]) -> None:
        """A new generation starts from this prompt (the last id is the first root)."""

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        """A tree rooted at `root` with at most `budget` nodes besides the root."""

    def observe(self, emitted: list[int]) -> None:
        """The tokens the round emitted (accepted drafts + bonus), in order."""


class Skips(Protocol):
    def skip(self, root: int, emitted: list[int]) -> None:
        """A round ran from `root` without a tree of this drafter's and emitted `emitted`. Keep the
        context in step, lazily where that is cheaper (a draft model extends its cache once, at the
        next propose, instead of once a round)."""


def skips(drafter: Drafter) -> bool:
    """Whether the drafter keeps in step through `skip` in rounds without its tree. One without it
    gets the protocol's usual pair instead: a root-only propose before the round, observe after
    (a drafter may read state the round's commit changes, so the propose cannot wait for it)."""
    return callable(getattr(drafter, "skip", None))


@runtime_checkable
class GuessesAhead(Protocol):
    def guess_after(self, root: mx.array) -> mx.array | None:
        """The most likely token after `root` [1, 1], a token still on the device (the choice of a
        one-node round that is queued and committed, not landed), as a lazy [1, 1] array, or None
        where no guess can be made. Its round is the one-guess tree, whose tokens the drafter
        `observe`s after it lands, as after a propose; the guess must be the one `propose` with
        budget 1 would have put in the tree."""


@runtime_checkable
class ChainsOnDevice(Protocol):
    def chain_on_device(self, root: int, budget: int, max_depth: int) -> mx.array | None:
        """The chain of top-1 guesses after `root` as lazy device ids [depth], drafted without a host
        round trip, so that the round's verify is queued behind the draft (a GPU then runs the two
        back to back while the host builds the verify's graph); None where this round's tree is not
        such a chain (another tree builder, Weaver) or there is nothing to draft from, and `propose`
        drafts instead. The chain is the one `propose` drafts with the chain builder, except that no
        stop rule cuts it short (a cut needs the marginals on the host): it runs to
        min(budget, max_depth) and the drafter's own depth limit. Its round lands like a proposed
        one (`observe`)."""


@runtime_checkable
class Chains(Protocol):
    def chain_depth(self, max_depth: int) -> int | None:
        """The deepest chain this drafter's trees can be, where they are chains (the chain tree
        builder): a tree of any budget then has at most that many nodes below its root; None
        where its trees fill their budget. The tree-size controller predicts an untried tree's
        time by its rows (engine/spec_control.py): a chain at depth 6 verifies 7 rows, not the 17
        of its budget of 16."""


@runtime_checkable
class Hindsight(Protocol):
    """A drafter that can tell, for free, what its trees would have done in rounds it was told
    with `skip`: the tree-size controller learns from it whether guesses hit while it decodes
    without trees, instead of from re-tries that cost a round each where they miss."""

    def watch(self, budgets: Sequence[int], max_depth: int) -> None:
        """From the next round on, check in every round told with `skip` the trees `propose` would
        have drafted with these budgets (none: check nothing, at no cost)."""

    def hindsight(self) -> list[tuple[int, int, int]]:
        """(budget, tokens a round with that tree would have emitted, the round's evidence class)
        for each watched budget and skipped round whose outcome became known since the last call
        (a tree's outcome is known once a token after it missed it or it ran out of nodes, a round
        or a few later). The class is `Evidence.evidence()`'s at that round, 0 for a drafter
        without it."""
        ...


@runtime_checkable
class Evidence(Protocol):
    """A drafter that tells, for free, how good its next guesses are likely to be, as one of
    `classes` classes (the n-gram drafter: how long a match its continuations come from). The
    tree-size controller keeps one controller per class (engine/spec_evidence.py)."""

    classes: int

    def evidence(self) -> int:
        """The class (0 .. classes - 1, higher: stronger) of a round rooted at the last token the
        drafter has seen."""
        ...


@runtime_checkable
class ReadsTarget(Protocol):
    """A drafter fed by the target's hidden states (DFlash, MTP). Before `begin`, the engine hands
    it the target's FeatureCache of the generation, whose taps cover `taps`."""

    taps: FeatureTaps

    def attach(self, features: FeatureCache) -> None: ...


class NoDrafter:
    """Plain decoding through the same loop: a one-node tree every round."""

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        return DraftTree.single(root)

    def observe(self, emitted: list[int]) -> None:
        pass

    def skip(self, root: int, emitted: list[int]) -> None:
        pass
