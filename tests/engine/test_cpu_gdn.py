"""The CPU's own Gated DeltaNet core (engine/gdn/core.py CpuCore: engine/cpu_ext.cpp's gdn_step,
gdn_chain, gdn_tree, gdn_commit) against its twin in MLX's operations (OpsCore), and the promise it
keeps beyond the twin: a verify's rows, the state committed after it and a prefilled chain's
outputs and states are bit for bit what plain decoding's steps give for the same tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext
from engine.forward import tree_batch
from engine.gdn import ops
from engine.gdn.core import CpuCore, GDNShape, GDNWeights, OpsCore, TreeInputs
from engine.tree import DraftTree

pytestmark = pytest.mark.skipif(cpu_ext.module() is None,
                                reason="engine/cpu_ext.cpp not built here (no C++ compiler, headers or nanobind)")

SHAPES = [GDNShape(Hk=6, Hv=12, Dk=32, Dv=32, K=4), GDNShape(Hk=2, Hv=2, Dk=16, Dv=24, K=4),
          GDNShape(Hk=1, Hv=4, Dk=8, Dv=8, K=2)]


def arr(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32))


def inputs(rng: np.random.Generator, shape: GDNShape, n: int):
    C = shape.conv_dim
    w = GDNWeights(arr(rng.normal(size=(C, shape.K)) * 0.5), arr(rng.normal(size=shape.Hv) * 0.5),
                   arr(rng.normal(size=shape.Hv)), None)
    x, a, b = arr(rng.normal(size=(n, C))), arr(rng.normal(size=(n, shape.Hv))), arr(rng.normal(size=(n, shape.Hv)))
    conv_state = arr(rng.normal(size=(shape.K - 1, C)))
    S = arr(rng.normal(size=(shape.Hv, shape.Dv, shape.Dk)) * 0.3)
    return w, x, a, b, conv_state, S


def random_tree(rng: np.random.Generator, n: int) -> DraftTree:
    return DraftTree(tuple(range(n)), (-1, *(int(rng.integers(0, i)) for i in range(1, n))))


def tree_inputs(tree: DraftTree, K: int) -> TreeInputs:
    """The tree's GDN inputs as a verify builds them (engine/forward.py tree_batch; one node has
    none there, so built the same way here)."""
    gdn = tree_batch(tree, 7, K).gdn
    if gdn is None:
        gdn = TreeInputs(mx.array(ops.tree_conv_taps(tree.parents, K)), ops.tree_masks(tree.ancestor_mask()),
                         mx.array(tree.dfs_order), mx.array(tree.depths), 1)
    return gdn


def close(a: mx.array, b: mx.array) -> None:
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_step_equals_the_ops(shape, rng):
    w, x, a, b, conv_state, S = inputs(rng, shape, 1)
    args = (shape, w, x, a, b, conv_state, S)
    for got, want in zip(CpuCore().step(*args), OpsCore().step(*args), strict=True):
        close(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 2, 7, 17])
def test_tree_and_commit_equal_the_ops(shape, n, rng):
    w, x, a, b, conv_state, S0 = inputs(rng, shape, n)
    tree = random_tree(rng, n)
    gdn = tree_inputs(tree, shape.K)
    o, rows = CpuCore().tree(shape, w, x, a, b, conv_state, S0, gdn)
    o_ops, rows_ops = OpsCore().tree(shape, w, x, a, b, conv_state, S0, gdn)
    close(o, o_ops)
    for name in ("x", "k", "u", "g"):
        close(getattr(rows, name), getattr(rows_ops, name))
    path = mx.array(tree.path_to(n - 1), dtype=mx.int32)
    for got, want in zip(CpuCore().commit(rows, path, conv_state, S0), OpsCore().commit(rows_ops, path, conv_state, S0),
                         strict=True):
        close(got, want)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 2, 3, 33, 100])
def test_chain_equals_the_ops(shape, n, rng):
    """A prefill's chain against the chunked dense form (32 rows a block: 33 and 100 cross blocks;
    fewer tokens than conv taps take rows of the committed conv state into the new one)."""
    w, x, a, b, conv_state, S = inputs(rng, shape, n)
    args = (shape, w, x, a, b, conv_state, S)
    for got, want in zip(CpuCore().chain(*args), OpsCore().chain(*args), strict=True):
        close(got, want)


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.parametrize("n", [1, 2, 40])
def test_a_chain_is_bitwise_plain_decoding(shape, n, rng):
    """Each token's output of the chain, and the conv state and state after it, equal the steps
    that decode the same tokens one by one, bit for bit."""
    w, x, a, b, conv_state, S0 = inputs(rng, shape, n)
    o, conv_chain, S_chain = CpuCore().chain(shape, w, x, a, b, conv_state, S0)
    core, conv, S = CpuCore(), conv_state, S0
    for j in range(n):
        step_o, conv, S = core.step(shape, w, x[j : j + 1], a[j : j + 1], b[j : j + 1], conv, S)
        assert np.array_equal(np.array(step_o)[0], np.array(o)[j]), f"token {j}"
    assert np.array_equal(np.array(S_chain), np.array(S))
    assert np.array_equal(np.array(conv_chain), np.array(conv))


def test_the_chain_switch_falls_back(monkeypatch, rng):
    shape = SHAPES[1]
    w, x, a, b, conv_state, S = inputs(rng, shape, 5)
    monkeypatch.setattr(cpu_ext, "GDN_CHAIN", False)
    want = OpsCore().chain(shape, w, x, a, b, conv_state, S)
    assert all(np.array_equal(np.array(g), np.array(h))
               for g, h in zip(CpuCore().chain(shape, w, x, a, b, conv_state, S), want, strict=True))


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_a_verify_is_bitwise_plain_decoding(shape, rng):
    """Every node's output equals the step that decodes it after its ancestors, and the committed
    state and conv state equal those steps', bit for bit."""
    n = 9
    w, x, a, b, conv_state, S0 = inputs(rng, shape, n)
    tree = random_tree(rng, n)
    o, rows = CpuCore().tree(shape, w, x, a, b, conv_state, S0, tree_inputs(tree, shape.K))
    core = CpuCore()
    for node in range(n):
        path = tree.path_to(node)
        conv, S = conv_state, S0
        for j in path:
            step_o, conv, S = core.step(shape, w, x[j : j + 1], a[j : j + 1], b[j : j + 1], conv, S)
        assert np.array_equal(np.array(step_o)[0], np.array(o)[node]), f"node {node}"
        commit_conv, commit_S = core.commit(rows, mx.array(path, dtype=mx.int32), conv_state, S0)
        assert np.array_equal(np.array(commit_S), np.array(S)), f"state after node {node}"
        assert np.array_equal(np.array(commit_conv), np.array(conv)), f"conv state after node {node}"


def test_a_padded_path_commits_its_nodes_only(rng):
    shape = SHAPES[0]
    w, x, a, b, conv_state, S0 = inputs(rng, shape, 5)
    _, rows = CpuCore().tree(shape, w, x, a, b, conv_state, S0, tree_inputs(DraftTree.chain(0, range(1, 5)), shape.K))
    want = cpu_ext.gdn_commit(rows.k, rows.u, rows.g, mx.array([0, 1, 2], dtype=mx.int32), S0)
    got = cpu_ext.gdn_commit(rows.k, rows.u, rows.g, mx.array([0, 1, 2, -1, -1], dtype=mx.int32), S0)
    assert np.array_equal(np.array(got), np.array(want))


def test_other_dtypes_and_the_switches_fall_back(monkeypatch, rng):
    shape = SHAPES[1]
    w, x, a, b, conv_state, S = inputs(rng, shape, 1)
    want = OpsCore().step(shape, w, x.astype(mx.bfloat16), a, b, conv_state, S)
    got = CpuCore().step(shape, w, x.astype(mx.bfloat16), a, b, conv_state, S)  # not float32: OpsCore's
    assert all(np.array_equal(np.array(g.astype(mx.float32)), np.array(h.astype(mx.float32)))
               for g, h in zip(got, want, strict=True))
    monkeypatch.setattr(cpu_ext, "GDN_STEP", False)
    want = OpsCore().step(shape, w, x, a, b, conv_state, S)
    assert all(np.array_equal(np.array(g), np.array(h))
               for g, h in zip(CpuCore().step(shape, w, x, a, b, conv_state, S), want, strict=True))


def test_bad_shapes_are_refused(rng):
    shape = SHAPES[0]
    w, x, a, b, conv_state, S = inputs(rng, shape, 1)
    ext = cpu_ext.module()
    with pytest.raises(ValueError, match="shapes"):
        ext.gdn_step(x, a, b, conv_state, S, w.conv, w.A_log, w.dt_bias, 5, shape.Dk)  # 12 heads over 5
    with pytest.raises(ValueError, match="shapes"):
        ext.gdn_tree(x, a, b, mx.zeros((1, 3), dtype=mx.int32), conv_state, S, w.conv, w.A_log, w.dt_bias,
                     shape.Hk, shape.Dk)
    with pytest.raises(ValueError, match="shapes"):
        ext.gdn_chain(x, a[:, :5], b, conv_state, S, w.conv, w.A_log, w.dt_bias, shape.Hk, shape.Dk)
    with pytest.raises(ValueError, match="float32"):
        ext.gdn_commit(S.astype(mx.float16), S, S[:, :, 0], mx.zeros((1,), dtype=mx.int32), S)


def test_a_strided_path_is_read_by_its_strides(rng):
    shape = SHAPES[0]
    w, x, a, b, conv_state, S0 = inputs(rng, shape, 4)
    _, rows = CpuCore().tree(shape, w, x, a, b, conv_state, S0, tree_inputs(DraftTree.chain(0, range(1, 4)), shape.K))
    dense = cpu_ext.gdn_commit(rows.k, rows.u, rows.g, mx.array([0, 1, 2], dtype=mx.int32), S0)
    spread = mx.array([0, 9, 1, 9, 2, 9], dtype=mx.int32)[::2]  # a view: every other element
    assert np.array_equal(np.array(cpu_ext.gdn_commit(rows.k, rows.u, rows.g, spread, S0)), np.array(dense))
