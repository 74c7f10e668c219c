"""DraftTree: validation, depths, masks, paths, positions on random trees.

Also home of the shared test helpers `draft_trees` (hypothesis strategy) and `rng` (fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from engine.tree import DraftTree
from tests.unit.strategies import draft_trees


def _brute_ancestors(tree: DraftTree, i: int) -> set[int]:
    out = {i}
    while i != 0:
        i = tree.parents[i]
        out.add(i)
    return out


@settings(max_examples=150, deadline=None)
@given(draft_trees())
def test_derived_arrays_match_brute_force(tree: DraftTree) -> None:
    n = tree.size
    m = tree.ancestor_mask()
    assert m.shape == (n, n) and m.dtype == bool
    for i in range(n):
        anc = _brute_ancestors(tree, i)
        assert set(np.flatnonzero(m[i]).tolist()) == anc
        assert tree.depths[i] == len(anc) - 1
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i and set(path) == anc
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert tree.children(i) == tuple(j for j in range(n) if tree.parents[j] == i)
        for c in tree.children(i):
            assert tree.child_with_token(i, tree.tokens[c]) == c
    assert tree.depths.dtype == np.int32
    assert tree.max_depth == max(len(tree.path_to(i)) for i in range(n)) - 1
    assert np.array_equal(tree.positions(17), 17 + tree.depths)


@settings(max_examples=50, deadline=None)
@given(draft_trees())
def test_derived_arrays_are_read_only(tree: DraftTree) -> None:
    with pytest.raises(ValueError):
        tree.ancestor_mask()[0, 0] = False
    with pytest.raises(ValueError):
        tree.depths[0] = 3


def test_single_and_chain() -> None:
    s = DraftTree.single(5)
    assert s.size == 1 and s.max_depth == 0 and s.children(0) == ()
    assert s.ancestor_mask().tolist() == [[True]]
    c = DraftTree.chain(5, [7, 7, 2])
    assert c.tokens == (5, 7, 7, 2) and c.parents == (-1, 0, 1, 2)
    assert np.array_equal(c.ancestor_mask(), np.tri(4, dtype=bool))
    assert c.depths.tolist() == [0, 1, 2, 3] and c.path_to(3) == [0, 1, 2, 3]
    assert c.positions(0).tolist() == [0, 1, 2, 3]
    assert c.child_with_token(1, 7) == 2 and c.child_with_token(1, 8) is None


def test_numpy_ints_are_accepted_and_normalised() -> None:
    t = DraftTree(tuple(np.array([3, 4, 5])), tuple(np.array([-1, 0, 0])))
    assert t.tokens == (3, 4, 5) and all(type(x) is int for x in t.tokens + t.parents)
    assert t == DraftTree((3, 4, 5), (-1, 0, 0))


@pytest.mark.parametrize(
    "tokens, parents, msg",
    [
        ((1, 2), (-1,), "differ in length"),
        ((), (), "at least the root"),
        ((1, 2), (0, 0), "parents\\[0\\] must be -1"),
        ((1, 2, 3), (-1, 0, 2), "topological"),
        ((1, 2, 3), (-1, 0, -1), "topological"),
        ((1, 2, 3), (-1, 5, 0), "topological"),
        ((1, 2, 2), (-1, 0, 0), "repeats token 2"),
        ((1, -2), (-1, 0), ">= 0"),
        ((1, 2.0), (-1, 0), "must be an int"),
        ((1, True), (-1, 0), "must be an int"),
    ],
)
def test_invalid_trees_raise(tokens, parents, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        DraftTree(tokens, parents)


def test_same_token_under_different_parents_is_fine() -> None:
    t = DraftTree((0, 1, 2, 1, 1), (-1, 0, 0, 1, 2))
    assert t.children(0) == (1, 2) and t.child_with_token(2, 1) == 4


def test_bad_node_index_and_position() -> None:
    t = DraftTree.chain(1, [2])
    with pytest.raises(IndexError):
        t.children(2)
    with pytest.raises(IndexError):
        t.path_to(-1)
    with pytest.raises(ValueError):
        t.positions(-1)
