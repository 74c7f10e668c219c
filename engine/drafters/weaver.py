"""Draft trees with the Weaver adapter over a DFlash drafter's block (tree builder "weaver").

Batched best-first search over joint path log-probabilities under Weaver's conditionals, as the
published builder does: the root is stepped first and its `expand_width` best candidates enter
the frontier; then, until the budget is spent, the best `nodes_per_call` frontier entries become
tree nodes and (unless at the depth limit, or the budget is then full) are stepped together in
one Weaver call, each pushing its own best candidates with score = its score + log q. Scores only
fall along a path, so every node's parent is in the tree before it (topological order), and the
candidates of one parent are distinct tokens. The tree depends on the drafter's outputs only,
never on the target's randomness, so the target-only accept walk keeps it lossless.
"""

from __future__ import annotations

import heapq
import math

import mlx.core as mx
import numpy as np

from engine.models.base import CausalLM
from engine.models.weaver import Weaver
from engine.tree import DraftTree


class WeaverTrees:
    def __init__(self, weaver: Weaver, target: CausalLM, expand_width: int = 8,
                 nodes_per_call: int | None = None) -> None:
        if weaver.config.d_model != target.args.hidden_size:
            raise ValueError(f"Weaver d_model {weaver.config.d_model} differs from the target's hidden size "
                             f"{target.args.hidden_size}")
        self.weaver, self.target = weaver, target
        self.expand_width, self.nodes_per_call = expand_width, nodes_per_call
        self._tables: tuple[mx.array, mx.array] | None = None

    def tables(self) -> tuple[mx.array, mx.array]:
        """[V, d_rank] each: every token's node input token_in(embed_norm(E[t])), and every
        token's score row W_lm[t] @ lm_head_query_in.weight (through the target's own lm_head,
        whatever its form: tied, untied, quantized)."""
        if self._tables is None:
            w, V = self.weaver, self.target.args.vocab_size
            E = self.target.model.embed_tokens(mx.arange(V))  # type: ignore[attr-defined]
            token_rows = w.token_in(w.embed_norm(E))
            score_rows = self.target.logits(w.lm_head_query_in.weight.T).T
            mx.eval(token_rows, score_rows)
            self._tables = (token_rows, score_rows)
        return self._tables

    def build(self, root: int, h_target: mx.array, hidden: mx.array, logits: mx.array,
              budget: int, max_depth: int, vocab: mx.array | None = None) -> DraftTree:
        """h_target [H]: the target's final-normed hidden state at the last committed position;
        hidden [D, H], logits [D, V]: DFlash's final hidden states and logits of depths 1..D, whose
        columns are the token ids `vocab` (a draft vocabulary) or, None, the whole vocabulary."""
        w = self.weaver
        depth_limit = min(hidden.shape[0], w.config.max_depth, max_depth)
        if budget < 1 or depth_limit < 1:
            return DraftTree.single(root)
        token_rows, score_rows = self.tables()
        pool = min(w.config.candidate_pool_size, logits.shape[-1])
        pool_ids = mx.argpartition(-logits[:depth_limit], pool - 1, axis=-1)[:, :pool]  # [D, P]
        pool_logits = mx.take_along_axis(logits[:depth_limit].astype(mx.float32), pool_ids, axis=-1)
        if vocab is not None:
            pool_ids = vocab[pool_ids]  # columns -> token ids (the score table's rows, the tree's tokens)
        prompt = w.prompt_kv(h_target, hidden[:depth_limit])
        # A Weaver call costs about the same for 1 node as for 8 (op overhead), and one call per
        # node made drafting 60 % of a round on the CPU; a quarter of the budget per call (4 calls)
        # kept most of the acceptance (BENCHMARKS.md, "One-pass drafters").
        per_call = self.nodes_per_call or math.ceil(budget / 4)

        tokens, parents, depths, scores = [root], [-1], [0], [0.0]
        kv_slot: dict[int, int] = {}  # tree node -> row of the stepped nodes' K/V
        ancestors: list[set[int]] = [set()]
        node_kv: list | None = None
        frontier: list[tuple[float, int, int, int]] = []  # (-score, order, parent node, token)
        order = 0

        def step(nodes: list[int]) -> None:
            nonlocal node_kv, order
            n = 0 if node_kv is None else node_kv[0][0].shape[1]
            sees = np.zeros((len(nodes), n), dtype=bool)
            for r, node in enumerate(nodes):
                for a in ancestors[node]:
                    sees[r, kv_slot[a]] = True
            d = mx.array([depths[i] for i in nodes])
            x = token_rows[mx.array([tokens[i] for i in nodes])]
            queries, new = w.step(x, d, prompt, node_kv, mx.array(sees))
            node_kv = new if node_kv is None else [(mx.concatenate([k0, k1], axis=1), mx.concatenate([v0, v1], axis=1))
                                                   for (k0, v0), (k1, v1) in zip(node_kv, new, strict=True)]
            for r, node in enumerate(nodes):
                kv_slot[node] = n + r
            # candidates of depth d + 1 are DFlash's pool of row d
            ids = pool_ids[d]  # [w, P]
            s = pool_logits[d] + (score_rows[ids] * queries[:, None, :]).sum(-1)
            logq = s - mx.logsumexp(s, axis=-1, keepdims=True)
            k = min(self.expand_width, pool)
            best = mx.argpartition(-logq, k - 1, axis=-1)[:, :k]
            best_ids, best_logq = mx.take_along_axis(ids, best, axis=-1), mx.take_along_axis(logq, best, axis=-1)
            mx.eval(best_ids, best_logq, node_kv)
            for r, node in enumerate(nodes):
                for tok, lq in zip(np.array(best_ids[r]).tolist(), np.array(best_logq[r]).tolist(), strict=True):
                    heapq.heappush(frontier, (-(scores[node] + lq), order, node, tok))
                    order += 1

        step([0])
        while frontier and len(tokens) <= budget:
            selected: list[int] = []
            while frontier and len(selected) < per_call and len(tokens) <= budget:
                neg, _, parent, tok = heapq.heappop(frontier)
                tokens.append(tok)
                parents.append(parent)
                depths.append(depths[parent] + 1)
                scores.append(-neg)
                ancestors.append(ancestors[parent] | {parent})
                selected.append(len(tokens) - 1)
            if len(tokens) > budget:
                break
            expandable = [n for n in selected if depths[n] < depth_limit]
            if expandable:
                step(expandable)
        return DraftTree(tuple(tokens), tuple(parents))
