"""Prompt-lookup / n-gram drafter: no model, works with every target.

The recent suffix of the context (prompt + generated) is looked up in an index of everything
seen so far; the tokens that followed earlier occurrences become draft branches. Several
occurrences with different continuations make a multi-branch tree (a trie of continuations).
Strong on code edits and repetitive text, free when it finds nothing.
"""

from __future__ import annotations

from collections import defaultdict

from engine.tree import DraftTree


class NgramDrafter:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_sites: int = 6) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_sites = max_ngram, min_ngram, max_sites
        self.ctx: list[int] = []
        self.hits = self.checked = 0  # hindsight of skipped rounds, since the last hindsight()
        # n -> n-gram -> end positions of its occurrences in ctx (ascending)
        self.index: dict[int, dict[tuple[int, ...], list[int]]] = {}

    def begin(self, prompt_ids: list[int]) -> None:
        self.ctx = []
        self.hits = self.checked = 0
        self.index = {n: defaultdict(list) for n in range(self.min_ngram, self.max_ngram + 1)}
        for t in prompt_ids:
            self._append(t)

    def observe(self, emitted: list[int]) -> None:
        for t in emitted:
            self._append(t)

    def skip(self, root: int, emitted: list[int]) -> None:
        # a dictionary lookup or four: whether the one-guess tree would have been right, for free
        if emitted:
            guess = self.continuations(1)
            self.checked += 1
            self.hits += bool(guess) and guess[0][0] == emitted[0]
        self.observe(emitted)  # the index is the context: nothing to gain by waiting

    def hindsight(self) -> tuple[int, int]:
        out = (self.hits, self.checked)
        self.hits = self.checked = 0
        return out

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
        tokens, parents = [root], [-1]
        for cont in self.continuations(max_depth):
            node = 0
            for t in cont:
                child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == t), None)
                if child is None:
                    if len(tokens) > budget:
                        break
                    tokens.append(t)
                    parents.append(node)
                    child = len(tokens) - 1
                node = child
        return DraftTree(tuple(tokens), tuple(parents))
