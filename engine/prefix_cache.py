"""Token-prefix store of cache snapshots, so repeated prompts skip their prefill.

Recurrent (GDN) and conv states cannot be truncated, so a hybrid model resumes only from a
stored snapshot whose tokens are a prefix of the new prompt; an attention-only model may resume
from any common prefix (its K/V are just cut). Snapshots are taken at the end of a prompt, the end
of a generation, and chat-message boundaries (before each `<|im_start|>`), so that the next turn
of a conversation, which re-renders the history, hits.

Keys live in a token trie, so a lookup walks the prompt once instead of comparing it with every
key. Bounded by bytes of the arrays actually held; when over budget, generation-end snapshots go
first (a conversation's next turn re-renders the answer and rarely resumes there), then the least
recently used of the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.cache import LayerCache, LayerSnapshot, restore_all, snapshot_all

Kind = Literal["boundary", "prompt", "generation"]


@dataclass(frozen=True)
class Snapshot:
    tokens: tuple[int, ...]
    layers: tuple[LayerSnapshot, ...]
    kind: Kind

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers)


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    snapshot: Snapshot | None = None


class PrefixCache:
    def __init__(self, budget_bytes: int, enabled: bool = True, trimmable: bool = False) -> None:
        self.budget, self.enabled, self.trimmable = budget_bytes, enabled, trimmable
        self.root = _Node()
        self.entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def clear(self) -> None:
        """Drop every snapshot (the engine's cache layout changed)."""
        self.root, self.entries, self.nbytes = _Node(), OrderedDict(), 0

    def lookup(self, prompt: Sequence[int]) -> tuple[Snapshot | None, int]:
        """The best snapshot for a prompt whose tokens [0, len(prompt)) go into the cache
        -> (snapshot, tokens of it to use). Hybrid: the longest stored key that is a prefix of the
        prompt; attention-only: any key sharing the longest common prefix, cut to it."""
        if not self.enabled:
            return None, 0
        best: tuple[Snapshot | None, int] = (None, 0)
        node, depth = self.root, 0
        for t in prompt:
            child = node.children.get(t)
            if child is None:
                break
            node, depth = child, depth + 1
            if node.snapshot is not None:
                best = (node.snapshot, depth)
        if self.trimmable and depth > best[1]:
            below = _any_snapshot(node)
            if below is not None:
                best = (below, depth)
        if best[0] is not None:
            self.entries.move_to_end(best[0].tokens)
        return best

    def restore_longest(self, prompt: Sequence[int], cache: list[LayerCache]) -> int:
        """Load the best snapshot for `prompt` into fresh caches -> tokens restored (0: none)."""
        snap, length = self.lookup(prompt)
        if snap is None:
            return 0
        restore_all(cache, snap.layers, length)
        return length

    def store(self, cache: list[LayerCache], tokens: Sequence[int], kind: Kind = "prompt") -> None:
        key = tuple(tokens)
        if not self.enabled or not key:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        snap = Snapshot(key, snapshot_all(cache, len(key)), kind)
        if snap.nbytes > self.budget:
            return
        node = self.root
        for t in key:
            node = node.children.setdefault(t, _Node())
        node.snapshot = snap
        self.entries[key] = snap
        self.nbytes += snap.nbytes
        while self.nbytes > self.budget:
            older = list(self.entries)[:-1]  # the snapshot just stored stays
            victims = [k for k in older if self.entries[k].kind == "generation"] or older
            self._evict(victims[0])

    def _evict(self, key: tuple[int, ...]) -> None:
        snap = self.entries.pop(key)
        self.nbytes -= snap.nbytes
        path = [self.root]
        for t in key:
            path.append(path[-1].children[t])
        path[-1].snapshot = None
        for depth in range(len(key), 0, -1):  # drop nodes that lead nowhere any more
            node = path[depth]
            if node.children or node.snapshot is not None:
                break
            del path[depth - 1].children[key[depth - 1]]


def _any_snapshot(node: _Node) -> Snapshot | None:
    """A snapshot stored at or below `node` (the nearest by breadth-first search)."""
    frontier = [node]
    while frontier:
        for n in frontier:
            if n.snapshot is not None:
                return n.snapshot
        frontier = [c for n in frontier for c in n.children.values()]
    return None
