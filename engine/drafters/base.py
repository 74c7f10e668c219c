"""The drafter protocol: propose a draft tree from the committed context, then observe
what the target accepted. Plain decoding is the drafter that proposes only the root."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.feature_cache import FeatureCache, FeatureTaps
from engine.tree import DraftTree


class Drafter(Protocol):
    def begin(self, prompt_ids: list[int]) -> None:
        """A new generation starts from this prompt (the last id is the first root)."""

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        """A tree rooted at `root` with at most `budget` nodes besides the root."""

    def observe(self, emitted: list[int]) -> None:
        """The tokens the round emitted (accepted drafts + bonus), in order."""


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
