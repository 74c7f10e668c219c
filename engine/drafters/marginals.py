"""Draft trees from per-depth marginals (what a one-pass drafter proposes: DFlash's block, MTP's
chain), deterministic for given marginals, under a node budget and a depth limit.

- `chain`: the top-1 token of every depth.
- `ddtree` (DDTree, Ringel & Romano): best-first over the infinite top-K tree whose path score is
  the sum of per-depth log-marginals (their product as a probability). Popping the best node and
  pushing its next sibling and its first child yields the `budget` highest-scoring nodes, a set
  closed under ancestors (a child never outscores its parent), which maximises the expected
  accepted length if the depths were independent.

Trees never depend on the target's randomness, so the target-only accept walk keeps them lossless
(engine/sampler.py). Siblings are distinct because each depth's top-K ids are.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.cpu_exp import logsumexp_rows
from engine.tree import DraftTree


@dataclass(frozen=True)
class Marginals:
    """Top-K of each depth's distribution. Row d is depth d + 1 (the root's child is depth 1)."""

    ids: np.ndarray  # int64 [D, K], most likely first
    logp: np.ndarray  # float64 [D, K], log-probabilities under the full distribution, descending

    @property
    def depth(self) -> int:
        return self.ids.shape[0]

    @classmethod
    def from_logits(cls, logits: mx.array, k: int) -> Marginals:
        """logits [D, V] (device) -> the top-k of every row; only [D, k] values reach the host."""
        ids, top = top_k_logp(logits, k)
        mx.eval(ids, top)
        return cls(np.array(ids).astype(np.int64), np.array(top).astype(np.float64))


def top_k_logp(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """logits [..., V] -> (ids, log-probabilities) of the k most likely, most likely first, [..., k].
    Pure (compilable); the log-softmax is taken in fp32 over the full vocabulary, and only the
    top k are normalised (the same subtraction as normalising every entry)."""
    x = logits.astype(mx.float32)
    k = min(k, x.shape[-1])
    ids = mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    top = mx.take_along_axis(x, ids, axis=-1) - logsumexp_rows(x)
    order = mx.argsort(-top, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(top, order, axis=-1)


def chain(root: int, m: Marginals, budget: int, max_depth: int) -> DraftTree:
    depth = max(0, min(budget, max_depth, m.depth))
    return DraftTree.chain(root, [int(t) for t in m.ids[:depth, 0]])


def ddtree(root: int, m: Marginals, budget: int, max_depth: int) -> DraftTree:
    depth_limit = min(max_depth, m.depth)
    if budget < 1 or depth_limit < 1:
        return DraftTree.single(root)
    k = m.ids.shape[1]
    tokens, parents = [root], [-1]
    # heap entries: (-score, rank path, parent node index); the rank path breaks ties
    # lexicographically (the likelier sibling, then the shallower branch, first)
    heap: list[tuple[float, tuple[int, ...], int]] = [(-m.logp[0, 0], (0,), 0)]
    while heap and len(tokens) <= budget:
        neg, path, parent = heapq.heappop(heap)
        d, r = len(path) - 1, path[-1]  # row d of the marginals, rank r
        tokens.append(int(m.ids[d, r]))
        parents.append(parent)
        node = len(tokens) - 1
        if r + 1 < k:
            heapq.heappush(heap, (neg + m.logp[d, r] - m.logp[d, r + 1], path[:-1] + (r + 1,), parent))
        if d + 1 < depth_limit:
            heapq.heappush(heap, (neg - m.logp[d + 1, 0], path + (0,), node))
    return DraftTree(tuple(tokens), tuple(parents))
