"""Prompt-lookup / n-gram drafter: no model, works with every target.

The recent suffix of the context (prompt + generated) is looked up in an index of everything
seen so far; the tokens that followed earlier occurrences become draft branches. Several
occurrences with different continuations make a multi-branch tree (a trie of continuations).
Strong on code edits and repetitive text, free when it finds nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.tree import DraftTree


@dataclass
class Trie:
    """A draft tree as the drafter builds it: node i's token and parent (node 0 the root), and
    (parent, token) -> child for its edges."""

    tokens: list[int]
    parents: list[int]
    edges: dict[tuple[int, int], int]

    def tree(self) -> DraftTree:
        return DraftTree(tuple(self.tokens), tuple(self.parents))


@dataclass
class Watched:
    """A tree the drafter would have proposed in a skipped round, matched against the tokens that
    came after it: its accepted path so far (node indices, the root's excluded).

    It is kept as the continuations it would be built from, and built (as a trie, never as a
    DraftTree: it is walked, not verified) only where the first token that came starts one of them.
    Where guesses miss that is rare, and building a 17-node tree every plain round, checked and
    indexed as a DraftTree, was ~11 of the ~27 us a plain round's bookkeeping took on the dev CPU
    (scripts/bench_bookkeeping.py; BENCHMARKS.md, issue 17, fifty-eighth session)."""

    root: int
    conts: list[list[int]]
    evidence: int = 0  # the drafter's evidence class for that round
    path: list[int] = field(default_factory=list)
    trie: Trie | None = None


# Matches of this many tokens or more make a round's evidence strong (class 1; shorter ones class
# 0): on the bundled target's output the top continuation after a match of 1-2 tokens was accepted
# for 0.2-0.3 tokens a round on real long text and after 3-4 for 1.1-1.2 (4.7-7.4 on code), so one
# controller per class sizes the trees of each (engine/spec_evidence.py; BENCHMARKS.md, issue 17).
STRONG_MATCH = 3


class NgramDrafter:
    classes = 2  # evidence: a longest match shorter than STRONG_MATCH, or not

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_sites: int = 6) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_sites = max_ngram, min_ngram, max_sites
        self.ctx: list[int] = []
        self.budgets: tuple[int, ...] = ()  # the trees checked in skipped rounds (watch)
        self.max_depth = 0
        self.watched: list[Watched] = []  # trees of skipped rounds whose outcome is not known yet
        self.seen: list[tuple[int, int, int]] = []  # known outcomes since the last hindsight()
        # n -> n-gram -> end positions of its occurrences in ctx (ascending)
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self._evidence = (-1, 0)  # (the context's length, its evidence), kept by evidence()

    def begin(self, prompt_ids: list[int]) -> None:
        self.ctx = []
        self._evidence = (-1, 0)
        self.watched, self.seen = [], []
        self.index = {n: defaultdict(list) for n in range(self.min_ngram, self.max_ngram + 1)}
        for t in prompt_ids:
            self._append(t)

    def observe(self, emitted: list[int]) -> None:
        self._match(emitted)
        for t in emitted:
            self._append(t)

    def skip(self, root: int, emitted: list[int]) -> None:
        if self.budgets:
            # the biggest watched tree holds the smaller ones: _trie adds nodes in the same order
            # whatever the budget, so the tree of budget b is its nodes 0..b (built at its first hit)
            self.watched.append(Watched(root, self.continuations(self.max_depth), self.evidence()))
        self.observe(emitted)  # the index is the context: nothing to gain by waiting

    def watch(self, budgets: Sequence[int], max_depth: int) -> None:
        self.budgets, self.max_depth = tuple(budgets), max_depth
        self.watched = []

    def hindsight(self) -> list[tuple[int, int, int]]:
        out, self.seen = self.seen, []
        return out

    def evidence(self) -> int:
        """1 where the context's last STRONG_MATCH tokens or more occurred before with a token
        after them (a continuation to propose), else 0: a few dictionary lookups, once per context
        length (a round asks it two to three times)."""
        if self._evidence[0] == len(self.ctx):
            return self._evidence[1]
        self._evidence = (len(self.ctx), self._strong())
        return self._evidence[1]

    def _strong(self) -> int:
        last = len(self.ctx) - 1
        for n in range(self.max_ngram, STRONG_MATCH - 1, -1):  # none where max_ngram < STRONG_MATCH
            if last + 1 < n or n not in self.index:  # (n below min_ngram is not indexed)
                continue
            ends = self.index[n].get(tuple(self.ctx[last + 1 - n :]), ())
            if ends and ends[0] < last:  # ascending: the earliest occurrence has tokens after it
                return 1
        return 0

    def _match(self, tokens: list[int]) -> None:
        """Walk the watched trees along the tokens that came; one that misses a token (or has no
        node left) is done: a round with it would have emitted its matched path and that token."""
        for t in tokens:
            going = []
            for w in self.watched:
                if w.trie is None and any(c[0] == t for c in w.conts):
                    w.trie = self._trie(w.root, w.conts, max(self.budgets))
                child = None if w.trie is None else w.trie.edges.get((w.path[-1] if w.path else 0, t))
                if child is None:
                    # node indices grow along a path: the tree of budget b matched its first nodes <= b
                    self.seen += [(b, 1 + sum(1 for n in w.path if n <= b), w.evidence) for b in self.budgets]
                else:
                    w.path.append(child)
                    going.append(w)
            self.watched = going

    def _append(self, token: int) -> None:
        self.ctx.append(token)
        end = len(self.ctx) - 1
        for n, table in self.index.items():
            if end + 1 >= n:
                table[tuple(self.ctx[end + 1 - n : end + 1])].append(end)

    def continuations(self, max_depth: int) -> list[list[int]]:
        """Continuations after earlier occurrences of the current suffix: longest n-gram first,
        most recent occurrence first, distinct ones only."""
        last = len(self.ctx) - 1
        seen, out = set(), []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if last + 1 < n:
                continue
            for end in reversed(self.index[n].get(tuple(self.ctx[last + 1 - n :]), ())):
                cont = tuple(self.ctx[end + 1 : min(end + 1 + max_depth, last + 1)])
                if end == last or not cont or cont in seen:
                    continue
                seen.add(cont)
                out.append(list(cont))
                if len(out) >= self.max_sites:
                    return out
        return out

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        return self._trie(root, self.continuations(max_depth), budget).tree()

    @staticmethod
    def _trie(root: int, continuations: list[list[int]], budget: int) -> Trie:
        """The trie of the continuations, nodes added in the same order whatever the budget (so the
        trie of budget b is the first b + 1 nodes of a bigger one's)."""
        trie = Trie([root], [-1], {})
        tokens, parents, edges = trie.tokens, trie.parents, trie.edges
        # the edges' dict instead of a scan of the nodes for each token (quadratic in the nodes)
        for cont in continuations:
            node = 0
            for t in cont:
                child = edges.get((node, t))
                if child is None:
                    if len(tokens) > budget:
                        break
                    tokens.append(t)
                    parents.append(node)
                    child = edges[(node, t)] = len(tokens) - 1
                node = child
        return trie
