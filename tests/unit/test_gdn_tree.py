"""Gated DeltaNet tree verify: per-node loop == dense form == fp64 reference; commit; chunked prefill; tree conv."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gdn.ops import chunked, commit_fold, conv_state_after, tree_conv, tree_conv_taps, tree_dense
from engine.gdn.reference import commit_replay, sequential, tree_sequential
from engine.gdn.triangular import SOLVERS, inverse_unit_lower, solve_unit_lower
from engine.tree import DraftTree
from tests.unit.strategies import draft_trees

TOL = 1e-5


def gdn_inputs(r: np.random.Generator, n: int, hv: int = 4, dk: int = 16, dv: int = 8, decay: float = 1.0):
    """Inputs shaped and scaled like a real layer: unit keys, q scaled by Dk^-1/2, g <= 0, beta in (0, 1)."""

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(r.normal(size=(n, hv, dk))) / np.sqrt(dk)
    k = unit(r.normal(size=(n, hv, dk)))
    v = r.normal(size=(n, hv, dv))
    g = -np.exp(r.normal(size=hv) - 1.0) * np.log1p(np.exp(r.normal(size=(n, hv)))) * decay
    beta = 1 / (1 + np.exp(-r.normal(size=(n, hv))))
    S0 = r.normal(size=(hv, dv, dk)) * 0.5
    return q, k, v, g, beta, S0


def reference_tree(q, k, v, g, beta, parents, S0):
    """fp64 numpy per-node recurrence; returns o, u and every node's state."""
    states, o, u = [], np.zeros(v.shape), np.zeros(v.shape)
    for i, p in enumerate(parents):
        S = np.exp(g[i])[:, None, None] * (S0 if p < 0 else states[p])
        u[i] = beta[i][:, None] * (v[i] - np.einsum("hvk,hk->hv", S, k[i]))
        S = S + u[i][:, :, None] * k[i][:, None, :]
        o[i] = np.einsum("hvk,hk->hv", S, q[i])
        states.append(S)
    return o, u, states


def maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def shaped_tree(shape: str, n: int, r: np.random.Generator) -> DraftTree:
    if shape == "chain":
        parents = [-1, *range(n - 1)]
    elif shape == "star":
        parents = [-1] + [0] * (n - 1)
    elif shape == "deep":  # three interleaved deep branches
        parents = [-1] + [0 if i <= 3 else i - 3 for i in range(1, n)]
    elif shape == "wide":  # short fans under the first few nodes
        parents = [-1] + [(i - 1) // 6 for i in range(1, n)]
    else:
        parents = [-1] + [int(r.integers(i)) for i in range(1, n)]
    return DraftTree(tuple(range(n)), tuple(parents))


@pytest.mark.parametrize("shape", ["chain", "star", "deep", "wide", "random"])
@pytest.mark.parametrize("n", [1, 2, 17, 65])
def test_sequential_equals_dense_and_fp64(shape, n, rng) -> None:
    tree = shaped_tree(shape, n, rng)
    x = gdn_inputs(rng, n)
    o_ref, u_ref, _ = reference_tree(*x[:5], tree.parents, x[5])
    o_seq, u_seq = tree_sequential(*x[:5], tree.parents, x[5])
    assert o_seq.dtype == mx.float32 and o_seq.shape == (n, 4, 8) and u_seq.shape == (n, 4, 8)
    assert maxdiff(o_seq, o_ref) <= TOL and maxdiff(u_seq, u_ref) <= TOL
    for solver in SOLVERS:
        o_d, u_d = tree_dense(*x[:5], tree.ancestor_mask(), x[5], solver=solver)
        assert maxdiff(o_d, o_seq) <= TOL, solver
        assert maxdiff(u_d, u_seq) <= TOL, solver
        assert maxdiff(o_d, o_ref) <= TOL, solver


@settings(max_examples=25, deadline=None)
@given(draft_trees(max_nodes=40), st.integers(0, 2**32 - 1), st.sampled_from([0.05, 1.0, 30.0]))
def test_sequential_equals_dense_random_trees(tree, seed, decay) -> None:
    x = gdn_inputs(np.random.default_rng(seed), tree.size, hv=3, dk=8, dv=12, decay=decay)
    o_seq, u_seq = tree_sequential(*x[:5], tree.parents, x[5])
    for solver in SOLVERS:
        o_d, u_d = tree_dense(*x[:5], tree.ancestor_mask(), x[5], solver=solver)
        assert not np.isnan(np.asarray(o_d)).any()
        assert maxdiff(o_d, o_seq) <= TOL and maxdiff(u_d, u_seq) <= TOL


def test_strong_decay_has_no_nan(rng) -> None:
    # off-mask prefix differences are huge and positive here; they must be masked before exp
    tree = shaped_tree("wide", 40, rng)
    x = list(gdn_inputs(rng, 40))
    x[3] = x[3] * 0 - 60.0
    o_d, u_d = tree_dense(*x[:5], tree.ancestor_mask(), x[5])
    o_seq, _ = tree_sequential(*x[:5], tree.parents, x[5])
    assert np.isfinite(np.asarray(o_d)).all() and maxdiff(o_d, o_seq) <= TOL


@settings(max_examples=25, deadline=None)
@given(draft_trees(max_nodes=30), st.integers(0, 2**32 - 1), st.data())
def test_commit_fold_equals_replay_equals_path_state(tree, seed, data) -> None:
    x = gdn_inputs(np.random.default_rng(seed), tree.size, hv=2, dk=8, dv=4)
    q, k, v, g, beta, S0 = x
    _, u = tree_dense(q, k, v, g, beta, tree.ancestor_mask(), S0)
    leaf = data.draw(st.integers(0, tree.size - 1))
    path = tree.path_to(leaf)
    fold = commit_fold(k, u, g, path, S0)
    replay = commit_replay(k, v, g, beta, path, S0)
    _, chain_state = sequential(q[path], k[path], v[path], g[path], beta[path], S0)
    _, _, ref_states = reference_tree(q, k, v, g, beta, tree.parents, S0)
    assert fold.shape == (2, 4, 8)
    assert maxdiff(fold, replay) <= TOL and maxdiff(fold, chain_state) <= TOL
    assert maxdiff(fold, ref_states[leaf]) <= TOL


def test_root_only_commit_still_advances(rng) -> None:
    q, k, v, g, beta, S0 = gdn_inputs(rng, 5)
    _, u = tree_sequential(q, k, v, g, beta, [-1, 0, 0, 1, 2], S0)
    fold = commit_fold(k, u, g, [0], S0)
    _, _, ref = reference_tree(q, k, v, g, beta, [-1, 0, 0, 1, 2], S0)
    assert maxdiff(fold, ref[0]) <= TOL and maxdiff(fold, S0) > 1e-3


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
def test_chunked_equals_sequential(t, rng) -> None:
    q, k, v, g, beta, S0 = gdn_inputs(rng, t, hv=3, dk=16, dv=16)
    o_seq, s_seq = sequential(q, k, v, g, beta, S0)
    o_ref, _, states = reference_tree(q, k, v, g, beta, [-1, *range(t - 1)], S0)
    assert maxdiff(o_seq, o_ref) <= TOL and maxdiff(s_seq, states[-1]) <= TOL
    for solver in SOLVERS:
        o_c, s_c = chunked(q, k, v, g, beta, S0, chunk=64, solver=solver)
        assert o_c.shape == (t, 3, 16) and s_c.shape == (3, 16, 16)
        assert maxdiff(o_c, o_seq) <= TOL and maxdiff(s_c, s_seq) <= TOL
    o_small, s_small = chunked(q, k, v, g, beta, S0, chunk=7)
    assert maxdiff(o_small, o_seq) <= TOL and maxdiff(s_small, s_seq) <= TOL


def chain_conv(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp64 decode-style conv over rows x [L, C]: window = (state, x_t); returns outputs and final state."""
    out = []
    for row in x:
        window = np.concatenate([state, row[None]])  # [K, C]
        y = (window * w.T).sum(axis=0)
        out.append(y / (1 + np.exp(-y)))
        state = window[1:]
    return np.array(out), state


@pytest.mark.parametrize("kernel", [2, 3, 4, 5])
@pytest.mark.parametrize("shape", ["chain", "star", "deep", "random"])
def test_tree_conv_equals_chain_conv_along_paths(kernel, shape, rng) -> None:
    tree = shaped_tree(shape, 12, rng)
    c = 6
    x = rng.normal(size=(12, c))
    state = rng.normal(size=(kernel - 1, c))
    w = rng.normal(size=(c, kernel))
    y = np.asarray(tree_conv(x, state, w, mx.array(tree_conv_taps(tree.parents, kernel))))
    assert y.shape == (12, c)
    for i in range(tree.size):
        path = tree.path_to(i)
        y_chain, state_chain = chain_conv(x[path], state, w)
        assert maxdiff(y[i], y_chain[-1]) <= TOL, (i, path)
        assert maxdiff(conv_state_after(mx.array(x), mx.array(path), mx.array(state)), state_chain) <= TOL


def test_tree_conv_taps_read_committed_state_past_the_root() -> None:
    taps = tree_conv_taps([-1, 0, 1, 1], 4)  # rows 0..2 = committed state, 3.. = nodes
    assert taps.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 6]]


def test_bad_inputs_raise(rng) -> None:
    q, k, v, g, beta, S0 = gdn_inputs(rng, 3)
    tree = DraftTree.chain(0, [1, 2])
    with pytest.raises(ValueError, match="S0 must have shape"):
        tree_sequential(q, k, v, g, beta, tree.parents, S0[:, :, :3])
    with pytest.raises(ValueError, match="beta must have shape"):
        tree_dense(q, k, v, g, beta[:2], tree.ancestor_mask(), S0)
    with pytest.raises(ValueError, match="parents"):
        tree_sequential(q, k, v, g, beta, [-1, 0, 2], S0)
    with pytest.raises(ValueError, match="ancestor_mask"):
        tree_dense(q, k, v, g, beta, np.ones((3, 3), dtype=bool), S0)
    not_closed = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=bool)  # node 2 misses the root
    with pytest.raises(ValueError, match="single-rooted tree"):
        tree_dense(q, k, v, g, beta, not_closed, S0)
    two_roots = np.eye(3, dtype=bool)
    with pytest.raises(ValueError, match="single-rooted tree"):
        tree_dense(q, k, v, g, beta, two_roots, S0)
    with pytest.raises(ValueError, match="solver"):
        tree_dense(q, k, v, g, beta, tree.ancestor_mask(), S0, solver="lu")
    with pytest.raises(ValueError, match="path"):
        commit_fold(k, v, g, [1, 2], S0)
    with pytest.raises(ValueError, match="path"):
        commit_replay(k, v, g, beta, [0, 3], S0)
    with pytest.raises(ValueError, match="chunk"):
        chunked(q, k, v, g, beta, S0, chunk=0)
    with pytest.raises(ValueError, match="conv_state"):
        tree_conv(np.zeros((3, 4)), np.zeros((2, 4)), np.zeros((4, 4)), mx.array(tree_conv_taps(tree.parents, 4)))
    with pytest.raises(ValueError, match="kernel size"):
        tree_conv_taps([-1], 1)


def correlated_inputs(r: np.random.Generator, n: int, corr: float, hv: int = 2, dk: int = 32, dv: int = 32):
    """Keys sharing one direction (pairwise correlation ~corr), the case that breaks series solves."""
    q, k, v, g, beta, S0 = gdn_inputs(r, n, hv=hv, dk=dk, dv=dv)
    common = r.normal(size=(1, hv, dk))
    k = np.sqrt(corr) * common + np.sqrt(1 - corr) * r.normal(size=(n, hv, dk))
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, v, g * 0.05, beta, S0  # slow decay: old keys keep their weight


@pytest.mark.parametrize("chunk", [32, 64])
def test_chunked_is_accurate_with_correlated_keys(chunk, rng) -> None:
    # Regression: the matmul-only Neumann series used off the CPU lost all precision here
    # (T = 128, Dk = Dv = 32, key correlation 0.8: max error 9.5e-2 at chunk 32, 2e12 at chunk 64).
    q, k, v, g, beta, S0 = correlated_inputs(rng, 128, 0.8)
    o_ref, _, states = reference_tree(q, k, v, g, beta, [-1, *range(127)], S0)
    for solver in SOLVERS:
        o, S = chunked(q, k, v, g, beta, S0, chunk=chunk, solver=solver)
        assert maxdiff(o, o_ref) <= 1e-4, solver
        assert maxdiff(S, states[-1]) <= 1e-4, solver


@pytest.mark.parametrize("shape", ["chain", "star", "random"])
def test_tree_dense_is_accurate_with_correlated_keys(shape, rng) -> None:
    tree = shaped_tree(shape, 33, rng)
    x = correlated_inputs(rng, 33, 0.9)
    o_ref, u_ref, _ = reference_tree(*x[:5], tree.parents, x[5])
    for solver in SOLVERS:
        o, u = tree_dense(*x[:5], tree.ancestor_mask(), x[5], solver=solver)
        assert maxdiff(o, o_ref) <= 1e-4 and maxdiff(u, u_ref) <= 1e-4, solver


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 33, 64])
def test_blocked_inverse_equals_fp64_inverse(n, rng) -> None:
    A = np.tril(rng.normal(size=(3, n, n)) * 0.3, -1)
    ref = np.linalg.inv(np.eye(n) + A)
    T = inverse_unit_lower(mx.array(A.astype(np.float32)))
    assert T.shape == (3, n, n)
    assert maxdiff(T, ref) <= 1e-5 * max(1.0, float(np.abs(ref).max()))
    rhs = rng.normal(size=(3, n, 5))
    U = solve_unit_lower(mx.array(A.astype(np.float32)), mx.array(rhs.astype(np.float32)), "blocked")
    assert maxdiff(U, ref @ rhs) <= 1e-4 * max(1.0, float(np.abs(ref @ rhs).max()))
