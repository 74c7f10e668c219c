"""Losslessness of the target-only accept walk.

1. Exact enumeration (no Monte Carlo): over every combination of per-node
   uniform cells, the distribution of what one accept round emits equals the
   target's own distribution of "sample until the sequence leaves the tree".
2. Seeded identity: speculative rounds over arbitrary trees emit exactly the
   token sequence that plain seeded sampling emits.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SamplingParams
from engine.sampler import accept, accept_walk, inverse_cdf, process_logits, sample_token
from engine.tree import DraftTree
from tests.unit.strategies import draft_trees

Dist = dict[tuple[int, ...], float]


def target_distribution(tree: DraftTree, probs: np.ndarray, stops: tuple[int, ...]) -> Dist:
    """P(emitted tokens) when the target samples token by token until it leaves the tree or stops."""
    out: Dist = defaultdict(float)

    def visit(node: int, prefix: tuple[int, ...], mass: float) -> None:
        for y in np.flatnonzero(probs[node] > 0).tolist():
            child = tree.child_with_token(node, y)
            if child is None or y in stops:
                out[prefix + (y,)] += mass * probs[node, y]
            else:
                visit(child, prefix + (y,), mass * probs[node, y])

    visit(0, (), 1.0)
    return dict(out)


def cells(p: np.ndarray) -> list[tuple[float, float]]:
    """(midpoint u, probability) of each token's interval of the CDF, p > 0 only."""
    cdf = np.cumsum(p)
    lo = np.concatenate([[0.0], cdf[:-1]])
    return [((lo[y] + cdf[y]) / 2 / cdf[-1], p[y]) for y in np.flatnonzero(p > 0)]


def walk_distribution(tree: DraftTree, probs: np.ndarray, stops: tuple[int, ...]) -> Dist:
    """P(emitted tokens) of accept_walk, summing the weight of every combination of per-node cells."""
    out: Dist = defaultdict(float)
    for combo in itertools.product(*(cells(probs[i]) for i in range(tree.size))):
        us = [u for u, _ in combo]
        acc = accept_walk(tree, lambda node: inverse_cdf(probs[node], us[node]), stops)
        out[acc.tokens] += float(np.prod([w for _, w in combo]))
    return dict(out)


def assert_same(a: Dist, b: Dist) -> None:
    assert set(a) == set(b), (sorted(a), sorted(b))
    for key in a:
        assert abs(a[key] - b[key]) < 1e-12, (key, a[key], b[key])


FIXED_TREES = [
    DraftTree((0, 1, 2, 0, 1), (-1, 0, 0, 1, 2)),  # two branches
    DraftTree.chain(2, [0, 1, 2, 0]),  # chain of 5
    DraftTree((0, 0, 1, 2, 1), (-1, 0, 0, 0, 1)),  # root's children cover all of V = 3
    DraftTree((1, 0, 1, 2, 0, 2), (-1, 0, 0, 1, 1, 2)),  # bushy, 6 nodes
    DraftTree.single(1),
]


def _target_rows(r: np.random.Generator, n: int, v: int, kind: str) -> np.ndarray:
    x = r.normal(size=(n, v)) * 2
    if kind == "banned":  # zero-probability tokens, incl. the first children's tokens sometimes
        x[r.random((n, v)) < 0.35] = -np.inf
        x[np.arange(n), r.integers(v, size=n)] = 0.0
    elif kind == "one_hot":
        x = np.full((n, v), -np.inf)
        x[np.arange(n), r.integers(v, size=n)] = 0.0
    elif kind == "ties":
        x = np.round(x / 2)
    return x


@pytest.mark.parametrize("tree", FIXED_TREES, ids=lambda t: f"n{t.size}")
@pytest.mark.parametrize("kind", ["plain", "banned", "one_hot", "ties"])
@pytest.mark.parametrize(
    "prm",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=2),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.1),
        SamplingParams(temperature=1.0, stop_token_ids=(2,)),
        SamplingParams(),
    ],
    ids=["t1", "topk", "topp_minp", "stop", "greedy"],
)
def test_exact_enumeration_fixed_trees(tree, kind, prm, rng) -> None:
    v = max(3, max(tree.tokens) + 1)
    for _ in range(5):
        logits = _target_rows(rng, tree.size, v, kind)
        probs = np.stack([process_logits(row, prm) for row in logits])
        expect = target_distribution(tree, probs, prm.stop_token_ids)
        assert abs(sum(expect.values()) - 1) < 1e-12
        assert_same(walk_distribution(tree, probs, prm.stop_token_ids), expect)


@settings(max_examples=60, deadline=None)
@given(draft_trees(max_nodes=6, vocab=4), st.integers(0, 2**32 - 1), st.sampled_from(["plain", "banned", "one_hot"]))
def test_exact_enumeration_random_trees(tree, seed, kind) -> None:
    logits = _target_rows(np.random.default_rng(seed), tree.size, 4, kind)
    probs = np.stack([process_logits(row, SamplingParams(temperature=1.0)) for row in logits])
    got = walk_distribution(tree, probs, ())
    assert_same(got, target_distribution(tree, probs, ()))
    # optimality of target-only: E[accepted drafts] = sum over non-root nodes of P_target(path to node)
    expected_accepted = sum(
        np.prod([probs[a, tree.tokens[b]] for a, b in zip(tree.path_to(i), tree.path_to(i)[1:])])
        for i in range(1, tree.size)
    )
    mean_accepted = sum(w * (len(toks) - 1) for toks, w in got.items())
    assert abs(mean_accepted - expected_accepted) < 1e-12


def test_cell_midpoints_hit_their_own_token() -> None:
    p = process_logits(np.array([0.3, -np.inf, 1.2, 0.0, -np.inf]), SamplingParams(temperature=1.0))
    assert [inverse_cdf(p, u) for u, _ in cells(p)] == [0, 2, 3]


# ---- seeded identity: speculation emits exactly what plain sampling emits ----

V = 6


class TableTarget:
    """A deterministic toy target: logits depend on the last two tokens and the length."""

    def __init__(self, seed: int) -> None:
        self.table = np.random.default_rng(seed).normal(size=(V, V, 3, V)) * 1.5

    def logits(self, seq: list[int]) -> np.ndarray:
        return self.table[seq[-2], seq[-1], len(seq) % 3]


def plain_generate(target: TableTarget, prompt: list[int], n: int, prm: SamplingParams, seed: int) -> list[int]:
    seq = list(prompt)
    while len(seq) < len(prompt) + n:
        y = sample_token(target.logits(seq), prm, seed, position=len(seq))
        seq.append(y)
        if y in prm.stop_token_ids:
            break
    return seq[len(prompt):]


def random_tree(r: np.random.Generator, root: int, oracle: list[int]) -> DraftTree:
    """Random tree; along one spine it often follows `oracle` (the true continuation) to get long accepts."""
    tokens, parents, spine = [root], [-1], 0
    for _ in range(int(r.integers(0, 11))):
        parent = spine if r.random() < 0.5 else int(r.integers(len(tokens)))
        depth = len(_path(parents, parent))
        used = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(V) if t not in used]
        want = oracle[depth - 1] if parent == spine and depth - 1 < len(oracle) and r.random() < 0.8 else None
        if not free:
            continue
        tok = want if want in free else int(r.choice(free))
        tokens.append(tok)
        parents.append(parent)
        if parent == spine and tok == want:
            spine = len(tokens) - 1
    return DraftTree(tuple(tokens), tuple(parents))


def _path(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


def spec_generate(target, prompt, n, prm, seed, r, oracle) -> tuple[list[int], int]:
    seq, rounds = list(prompt), 0
    while len(seq) < len(prompt) + n:
        committed_len = len(seq) - 1  # the root (last token) is not in the cache yet
        done = len(seq) - len(prompt)
        tree = random_tree(r, seq[-1], oracle[done:])
        logits = np.stack([target.logits(seq[:-1] + [tree.tokens[j] for j in tree.path_to(i)])
                           for i in range(tree.size)])
        acc = accept(tree, logits, prm, seed, committed_len)
        rounds += 1
        seq.extend(acc.tokens)
        if acc.bonus in prm.stop_token_ids:
            break
    return seq[len(prompt):len(prompt) + n], rounds


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(
        [
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.6, top_k=3),
            SamplingParams(temperature=1.5, top_p=0.9, min_p=0.05),
            SamplingParams(temperature=1.0, stop_token_ids=(5,)),
            SamplingParams(),
        ]
    ),
)
def test_spec_equals_plain_sampling(seed, prm) -> None:
    r = np.random.default_rng(seed)
    target = TableTarget(seed)
    prompt = r.integers(V, size=int(r.integers(2, 6))).tolist()
    n = 40
    plain = plain_generate(target, prompt, n, prm, seed)
    spec, rounds = spec_generate(target, prompt, n, prm, seed, r, oracle=plain)
    assert spec == plain
    if not prm.stop_token_ids and len(plain) == n:
        assert rounds < n  # the oracle spine made some rounds accept drafts
