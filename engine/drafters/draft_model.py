"""Draft-model drafter: a small model with the target's tokenizer grows a best-first tree.

EAGLE-2 style: level by level, each frontier node offers its top-k next tokens; a candidate's
score is its cumulative draft probability (product along the path); the best `width` candidates
form the next frontier, and finally the best `budget` nodes by score make the tree. Scores only
shrink along a path, so the kept set is closed under ancestors.

The draft model has its own caches (hybrid ones included). Each level is a tree verify of the
draft model from its committed state, so nothing needs rolling back; after the target's
accept, the accepted rows are appended to the draft cache with one chain forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine import verify
from engine.tree import DraftTree


@dataclass(frozen=True)
class DraftModelConfig:
    top_k: int = 4  # children offered per expanded node
    width: int = 6  # frontier size per level


class DraftModelDrafter:
    def __init__(self, model, config: DraftModelConfig = DraftModelConfig()) -> None:
        self.model, self.config = model, config
        self.cache = None
        self.committed = 0
        self.pending_root: int | None = None

    def begin(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.make_cache()
        self.committed = 0
        self._extend(prompt_ids[:-1])

    def _extend(self, ids: list[int]) -> None:
        if ids:
            h = self.model.hidden(mx.array([ids]), self.cache)
            mx.eval(h)
            self.committed += len(ids)

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        self.pending_root = root
        tokens, parents, scores = [root], [-1], [1.0]
        frontier = [0]
        for _ in range(max_depth):
            if not frontier or len(tokens) > budget:
                break
            tree = DraftTree(tuple(tokens), tuple(parents))
            logits = verify.verify(self.model, self.cache, tree, self.committed)  # never commits
            candidates = []
            for node in frontier:
                probs = _softmax(logits[node])
                for tok in np.argpartition(-probs, self.config.top_k)[: self.config.top_k]:
                    candidates.append((scores[node] * float(probs[tok]), node, int(tok)))
            candidates.sort(key=lambda c: -c[0])
            frontier = []
            for score, node, tok in candidates[: self.config.width]:
                tokens.append(tok)
                parents.append(node)
                scores.append(score)
                frontier.append(len(tokens) - 1)
        return _best(tokens, parents, scores, budget)

    def observe(self, emitted: list[int]) -> None:
        # rows to append: the root of this round and the accepted drafts (all but the bonus)
        self._extend([self.pending_root, *emitted[:-1]])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _best(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """Keep the root and the `budget` best nodes, renumbered in topological order."""
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    keep = sorted([0, *ranked])
    # a node's score <= its parent's, so ancestors of kept nodes are kept (ties broken by index)
    new_index = {old: new for new, old in enumerate(keep)}
    kept_parents = [-1] + [new_index[parents[i]] for i in keep[1:]]
    return DraftTree(tuple(tokens[i] for i in keep), tuple(kept_parents))
