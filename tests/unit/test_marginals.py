"""Trees from marginals: budget and depth respected, siblings distinct, closed under ancestors, and
DDTree's node set is the best `budget` nodes of the top-K tree by product of marginals."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.drafters.marginals import Marginals, chain, ddtree


def random_marginals(rng: np.random.Generator, depth: int, k: int, vocab: int = 50) -> Marginals:
    logits = rng.standard_normal((depth, vocab)) * 2
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-logp, axis=-1, kind="stable")[:, :k]
    return Marginals(ids, np.take_along_axis(logp, ids, axis=-1))


def path_score(tree, m: Marginals, node: int) -> float:
    path = tree.path_to(node)[1:]
    return sum(m.logp[d, list(m.ids[d]).index(tree.tokens[n])] for d, n in enumerate(path))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), depth=st.integers(1, 8), k=st.integers(1, 6),
       budget=st.integers(0, 40), max_depth=st.integers(0, 9))
def test_trees_respect_budget_and_depth(seed, depth, k, budget, max_depth):
    m = random_marginals(np.random.default_rng(seed), depth, k)
    for build in (chain, ddtree):
        tree = build(7, m, budget, max_depth)  # DraftTree itself rejects duplicate siblings
        assert tree.tokens[0] == 7 and tree.size <= budget + 1
        assert tree.max_depth <= min(max_depth, depth)
        for node in range(1, tree.size):  # depth d holds a top-k token of marginal row d - 1
            assert tree.tokens[node] in m.ids[tree.depths[node] - 1]


def test_ddtree_keeps_the_best_nodes():
    rng = np.random.default_rng(3)
    for _ in range(20):
        depth, k, budget = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(1, 30))
        m = random_marginals(rng, depth, k)
        tree = ddtree(0, m, budget, depth)
        got = sorted((path_score(tree, m, n) for n in range(1, tree.size)), reverse=True)
        every = [sum(m.logp[d, r] for d, r in enumerate(ranks))
                 for n in range(1, depth + 1) for ranks in itertools.product(range(k), repeat=n)]
        want = sorted(every, reverse=True)[: min(budget, len(every))]
        np.testing.assert_allclose(got, want, atol=1e-12)
        for node in range(1, tree.size):  # a child never outscores its parent: ancestors are in
            assert path_score(tree, m, node) <= path_score(tree, m, tree.parents[node]) + 1e-12


def test_chain_is_the_top_one_path():
    m = random_marginals(np.random.default_rng(5), 6, 3)
    tree = chain(1, m, budget=4, max_depth=8)
    assert tree.tokens == (1, *m.ids[:4, 0].tolist()) and tree.parents == (-1, 0, 1, 2, 3)


def test_marginals_from_logits():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    m = Marginals.from_logits(mx.array(logits), 5)
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_array_equal(m.ids, np.argsort(-logits, axis=-1)[:, :5])
    np.testing.assert_allclose(m.logp, np.take_along_axis(logp, m.ids, axis=-1), atol=1e-5)
