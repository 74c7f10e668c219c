"""Draft-model drafter ("draft", the default shape): a chain with siblings, cheap on
overhead-bound hardware.

The draft model decodes a greedy chain of `depth` tokens with its ordinary one-token step
(compiled, no host round trip inside the chain: the argmax stays on the device), and each level
also offers its next most likely tokens as sibling leaves, up to the node budget. The tree is the
chain plus those leaves.

Rollback needs no copies: the draft cache is marked after each chain step (engine/cache.py: a mark
holds recurrent states by reference and an attention offset past which rows are scratch). After
the target's accept the draft cache is set to the state after the accepted prefix of the chain,
plus one step if the target took a sibling.
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
class ChainConfig:
    siblings: int = 2  # alternatives offered per level besides the chain token


class DraftChainDrafter:
    def __init__(self, model: CausalLM, config: ChainConfig = ChainConfig(), fill: Fill | None = None) -> None:
        self.model, self.config = model, config
        self.fill = fill  # prefill through the draft model's prefix cache (engine/prefill.py)
        self.cache: list[LayerCache] = []
        self.chain: list[int] = []  # this round's chain tokens (root excluded)
        self.root = 0
        self.saved: list[list[object]] = []  # saved[d]: cache marks after consuming d tokens of [root, *chain]
        self.behind: list[int] = []  # tokens of skipped rounds the draft cache has not consumed yet

    def begin(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.make_cache()
        self.behind = []
        if self.fill is not None:
            self.fill(self.model, self.cache, prompt_ids[:-1])
        else:
            forward.extend(self.model, self.cache, prompt_ids[:-1])

    def skip(self, root: int, emitted: list[int]) -> None:
        self.behind += [root, *emitted[:-1]]  # consumed in one chain forward by the next propose

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        if self.behind:
            forward.extend(self.model, self.cache, self.behind)
            self.behind = []
        depth = max(0, min(max_depth, budget))
        k = 1 + self.config.siblings
        token, ids, probs = mx.array([root]), [], []
        self.root, self.saved = root, [self._state()]
        for _ in range(depth):
            logits = self.model(token.reshape(1, 1), self.cache)[0, 0]  # writes the draft cache
            self.saved.append(self._state())
            p = mx.softmax(logits.astype(mx.float32))
            top = mx.argpartition(-p, k - 1)[:k]
            top = top[mx.argsort(-p[top])]  # top[0] is the argmax: the next chain token
            ids.append(top)
            probs.append(p[top])
            token = top[:1]
        if depth:  # one evaluation for the whole chain; the marked states are computed on the way
            mx.eval(ids, probs, forward.state_arrays(self.cache))
        level_ids: list[list[int]] = [np.array(a).tolist() for a in ids]
        level_probs: list[list[float]] = [np.array(a).tolist() for a in probs]
        self.chain = [level[0] for level in level_ids]
        return self._tree(root, level_ids, level_probs, budget)

    def _tree(self, root: int, ids: list[list[int]], probs: list[list[float]], budget: int) -> DraftTree:
        tokens, parents = [root, *self.chain], [-1, *range(len(self.chain))]
        # siblings of chain node d+1 hang under chain node d; the likeliest go first
        leaves = sorted(((probs[d][j], d, ids[d][j]) for d in range(len(ids)) for j in range(1, len(ids[d]))),
                        key=lambda c: -c[0])
        for _, d, tok in leaves[: max(0, budget - len(self.chain))]:
            tokens.append(tok)
            parents.append(d)
        return DraftTree(tuple(tokens), tuple(parents))

    def observe(self, emitted: list[int]) -> None:
        """emitted = accepted drafts + bonus. Keep the state after root + the accepted drafts."""
        wanted = [self.root, *emitted[:-1]]  # rows the draft cache must hold after this round
        have = 0  # leading rows of `wanted` that some saved state has consumed
        while have < len(wanted) and have < len(self.saved) - 1 and wanted[have] == ([self.root, *self.chain])[have]:
            have += 1
        self._restore(self.saved[have])
        # a sibling, or the last chain token (its state was not kept)
        forward.extend(self.model, self.cache, wanted[have:])

    def _state(self) -> list[object]:
        return [c.mark() for c in self.cache]

    def _restore(self, marks: list[object]) -> None:
        for c, m in zip(self.cache, marks, strict=True):
            c.rewind(m)
