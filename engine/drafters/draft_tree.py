"""Draft-model drafter ("draft-tree"): a small model with the target's tokenizer grows a
best-first tree.

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

from engine import forward
from engine.cache import LayerCache
from engine.drafters.base import Fill
from engine.models.base import CausalLM
from engine.tree import DraftTree


@dataclass(frozen=True)
class DraftTreeConfig:
    top_k: int = 4  # children offered per expanded node
    width: int = 6  # frontier size per level
    # Candidates less likely than this are not added (the best one of each level always is):
    # measured on the bundled pair, pruning unlikely branches let deeper likely ones into the
    # budget (3.7 -> 6.9 tokens per forward at budget 16, depth 8).
    min_score: float = 0.02


class DraftTreeDrafter:
    def __init__(self, model: CausalLM, config: DraftTreeConfig = DraftTreeConfig(), fill: Fill | None = None) -> None:
        self.model, self.config = model, config
        self.fill = fill  # prefill through the draft model's prefix cache (engine/prefill.py)
        self.cache: list[LayerCache] = []
        self.committed = 0
        self.pending_root = 0
        self.behind: list[int] = []  # tokens of skipped rounds the draft cache has not consumed yet

    def begin(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.make_cache()
        self.committed = 0
        self.behind = []
        if self.fill is not None:
            self.fill(self.model, self.cache, prompt_ids[:-1])
            self.committed = len(prompt_ids) - 1
        else:
            self._extend(prompt_ids[:-1])

    def _extend(self, ids: list[int]) -> None:
        forward.extend(self.model, self.cache, ids)
        self.committed += len(ids)

    def skip(self, root: int, emitted: list[int]) -> None:
        self.behind += [root, *emitted[:-1]]  # consumed in one chain forward by the next propose

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        if self.behind:
            self._extend(self.behind)
            self.behind = []
        self.pending_root = root
        tokens, parents, scores = [root], [-1], [1.0]
        frontier = [0]
        for _ in range(max_depth):
            if not frontier or len(tokens) > budget:
                break
            tree = DraftTree(tuple(tokens), tuple(parents))
            top_p, top_ids = self._top_k(tree, frontier)
            candidates = [(scores[node] * float(p), node, int(t))
                          for node, ps, ts in zip(frontier, top_p, top_ids) for p, t in zip(ps, ts)]
            candidates.sort(key=lambda c: -c[0])
            frontier = []
            for score, node, tok in candidates[: self.config.width]:
                if score < self.config.min_score and frontier:
                    break
                tokens.append(tok)
                parents.append(node)
                scores.append(score)
                frontier.append(len(tokens) - 1)
        return _best(tokens, parents, scores, budget)

    def _top_k(self, tree: DraftTree, frontier: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Draft-model probabilities and ids of the top_k next tokens of each frontier node,
        computed on the device so only [F, top_k] values come to the host."""
        logits = forward.verify(self.model, self.cache, tree, self.committed)  # never commits
        probs = mx.softmax(logits[mx.array(frontier)].astype(mx.float32), axis=-1)
        ids = mx.argpartition(-probs, self.config.top_k - 1, axis=-1)[:, : self.config.top_k]
        return np.array(mx.take_along_axis(probs, ids, axis=-1)), np.array(ids)

    def observe(self, emitted: list[int]) -> None:
        # rows to append: the root of this round and the accepted drafts (all but the bonus)
        self._extend([self.pending_root, *emitted[:-1]])


def _best(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> DraftTree:
    """Keep the root and the `budget` best nodes, renumbered in topological order."""
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    keep = sorted([0, *ranked])
    # a node's score <= its parent's, so ancestors of kept nodes are kept (ties broken by index)
    new_index = {old: new for new, old in enumerate(keep)}
    kept_parents = [-1] + [new_index[parents[i]] for i in keep[1:]]
    return DraftTree(tuple(tokens[i] for i in keep), tuple(kept_parents))
