"""DraftTree: the token tree one verify pass checks.

Node 0 is the root: the last emitted token, which is not in the cache yet.
Nodes are stored in topological order (every parent before its children), so
a node's ancestors always have smaller indices and triangular solves over the
tree need no reordering. Derived arrays are computed once and returned
read-only, because the same tree feeds every layer of a verify pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]  # node 0 = root = last emitted token (not yet in the cache)
    parents: tuple[int, ...]  # parents[0] == -1; 0 <= parents[i] < i for i > 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(_as_int(t, "token") for t in self.tokens))
        object.__setattr__(self, "parents", tuple(_as_int(p, "parent") for p in self.parents))
        _validate(self.tokens, self.parents)

    @classmethod
    def single(cls, root: int) -> DraftTree:
        """The one-node tree of plain decoding."""
        return cls((root,), (-1,))

    @classmethod
    def chain(cls, root: int, drafts: Sequence[int]) -> DraftTree:
        """root -> drafts[0] -> drafts[1] -> ... (a linear draft)."""
        n = len(drafts)
        return cls((root, *drafts), (-1, *range(n)))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> np.ndarray:
        """int32 [N]; the root has depth 0."""
        d = np.zeros(self.size, dtype=np.int32)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return _readonly(d)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    def children(self, i: int) -> tuple[int, ...]:
        """Child node indices of node i, in node order."""
        self._check_node(i)
        return self._children[i]

    @cached_property
    def _child_by_token(self) -> tuple[dict[int, int], ...]:
        return tuple({self.tokens[c]: c for c in kids} for kids in self._children)

    def child_with_token(self, i: int, token: int) -> int | None:
        """The child of node i whose token is `token`, or None (siblings are unique)."""
        self._check_node(i)
        return self._child_by_token[i].get(token)

    @cached_property
    def _ancestor_mask(self) -> np.ndarray:
        m = np.zeros((self.size, self.size), dtype=bool)
        for i in range(self.size):
            if i > 0:
                m[i, :i] = m[self.parents[i], :i]
            m[i, i] = True
        return _readonly(m)

    def ancestor_mask(self) -> np.ndarray:
        """bool [N, N], inclusive: M[i, j] is True iff node j is an ancestor-or-self of i."""
        return self._ancestor_mask

    @cached_property
    def dfs_order(self) -> np.ndarray:
        """int32 [N] node indices in depth-first preorder (children in node order). Visiting nodes in
        this order, a node's parent is the last node visited one level up: a per-depth stack of
        states is all a node-by-node kernel has to keep."""
        order, stack = [], [0]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self._children[node]))
        return _readonly(np.array(order, dtype=np.int32))

    def positions(self, committed_len: int) -> np.ndarray:
        """int32 [N] absolute positions: committed_len + depth (the root sits at committed_len)."""
        if _as_int(committed_len, "committed_len") < 0:
            raise ValueError(f"committed_len must be >= 0, got {committed_len}")
        return (committed_len + self.depths).astype(np.int32)

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root down to node i (both included)."""
        self._check_node(i)
        path = [i]
        while path[-1] != 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def _check_node(self, i: int) -> None:
        if not 0 <= i < self.size:
            raise IndexError(f"node {i} out of range for a tree of {self.size} nodes")


def _as_int(x: object, what: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{what} must be an int, got {x!r}")
    return int(x)


def _validate(tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
    if len(tokens) != len(parents):
        raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) differ in length")
    if not tokens:
        raise ValueError("a DraftTree needs at least the root node")
    if parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {parents[0]}")
    if min(tokens) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(tokens)}")
    seen: set[tuple[int, int]] = set()
    for i in range(1, len(parents)):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: need 0 <= parent < {i} (topological order, one root)")
        if (p, tokens[i]) in seen:
            raise ValueError(f"node {i} repeats token {tokens[i]} among the children of node {p}")
        seen.add((p, tokens[i]))
