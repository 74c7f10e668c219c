"""The kernel bodies executed on the CPU (tests/kernels/emulate.py) against their plain-MLX twins:
indexing, conv windows, gates, norms, the tree walk and the commit, on fresh random inputs and
trees of many shapes. Runs wherever g++ is (CI included); the GPU run adds the SIMD lanes."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import AcceptedPath
from engine.forward import tree_batch
from engine.fused_norms import WPG
from engine.gdn import ops
from engine.gdn.core import Fold, GDNShape, GDNWeights, OpsCore, TreeInputs, split_heads
from engine.gdn.reference import sequential
from engine.kernels import (
    GATED_NORM,
    GDN_CHAIN,
    GDN_COMMIT,
    GDN_STEP,
    GDN_STEP_GATED,
    GDN_TREE,
    GDN_TREE_FOLD,
    GDN_TREE_FRONT,
    GDN_TREE_FRONT_FOLD,
)
from engine.tree import DraftTree
from tests.kernels.emulate import SIMT_AVAILABLE, emulate, emulate_simt, to_bf16_bits

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")

SHAPES = {"small": GDNShape(Hk=2, Hv=4, Dk=8, Dv=8, K=4), "bundled": GDNShape(Hk=6, Hv=12, Dk=32, Dv=32, K=4),
          "k3": GDNShape(Hk=1, Hv=3, Dk=4, Dv=2, K=3)}
F32 = np.float32


def random_layer(rng: np.random.Generator, s: GDNShape, n: int) -> dict[str, np.ndarray]:
    return {
        "qkv": rng.normal(size=(n, s.conv_dim)).astype(F32),
        "a": rng.normal(size=(n, s.Hv)).astype(F32),
        "b": rng.normal(size=(n, s.Hv)).astype(F32),
        "conv_state": rng.normal(size=(s.K - 1, s.conv_dim)).astype(F32),
        "conv_w": (rng.normal(size=(s.conv_dim, s.K)) * 0.5).astype(F32),
        "A_log": rng.normal(size=s.Hv).astype(F32),
        "dt_bias": rng.normal(size=s.Hv).astype(F32),
        "state": (rng.normal(size=(s.Hv, s.Dv, s.Dk)) * 0.3).astype(F32),
    }


def twin_args(x: dict[str, np.ndarray]) -> tuple:
    """(weights, qkv, a, b, conv_state, state): a core's arguments after the shape."""
    m = {k: mx.array(v) for k, v in x.items()}
    w = GDNWeights(m["conv_w"], m["A_log"], m["dt_bias"])
    return w, m["qkv"], m["a"], m["b"], m["conv_state"], m["state"]


def template(s: GDNShape, **extra: int) -> dict[str, int]:
    return dict(Hk=s.Hk, Hv=s.Hv, Dk=s.Dk, Dv=s.Dv, K=s.K, RPG=2, **extra)


def launch(s: GDNShape) -> dict[str, int]:
    return {"groups": s.Hv * s.Dv // 2, "threads": 2}  # RPG = 2 rows per group, one lane per row


def maxdiff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def a_tree(rng: np.random.Generator, kind: str, n: int) -> DraftTree:
    if kind == "chain":
        parents = [-1, *range(n - 1)]
    elif kind == "star":
        parents = [-1] + [0] * (n - 1)
    else:
        parents = [-1] + [int(rng.integers(i)) for i in range(1, n)]
    return DraftTree(tuple(range(n)), tuple(parents))


@pytest.mark.parametrize("shape", SHAPES)
def test_step_body_equals_twin(shape, rng, tmp_path):
    s = SHAPES[shape]
    x = random_layer(rng, s, 1)
    out = emulate(GDN_STEP, x, {"o": ((s.Hv, s.Dv), F32), "conv_out": ((s.K - 1, s.conv_dim), F32),
                                "state_out": ((s.Hv, s.Dv, s.Dk), F32)}, template(s), **launch(s), tmp=tmp_path)
    o, conv, S = OpsCore().step(s, *twin_args(x))
    assert maxdiff(out["o"], o[0]) <= 1e-5
    assert maxdiff(out["conv_out"], conv) == 0.0
    assert maxdiff(out["state_out"], S) <= 1e-5


GATED_SHAPES = {"bundled": GDNShape(Hk=6, Hv=12, Dk=32, Dv=32, K=4),
                "9b-heads": GDNShape(Hk=1, Hv=2, Dk=128, Dv=128, K=4),
                "narrow-v": GDNShape(Hk=2, Hv=4, Dk=64, Dv=48, K=3)}


@pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and Linux's ucontext")
@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize(("rpg", "z_type"), [(32, "float32"), (8, "bfloat16"), (16, "float32")])
def test_lockstep_gated_step_is_the_step_then_the_gated_norm(shape, rpg, z_type, rng, tmp_path):
    """The step's SPR_GATED_OUT build, one threadgroup a head with `rpg` SIMD groups (or as many as
    divide Dv), bit for bit the plain step (one SIMD group a row, two a threadgroup) followed by
    gated_norm.kernel, with 32 lanes in lockstep; the state and conv state too."""
    s = GATED_SHAPES[shape]
    rpg = next(r for r in (rpg, 16, 8, 4, 2, 1) if s.Dv % r == 0)
    x = random_layer(rng, s, 1)
    z = rng.normal(size=(1, s.Hv * s.Dv)).astype(F32) * 2
    nw = (rng.normal(size=(s.Dv,)) * 0.1 + 1).astype(F32)
    eps = np.array([1e-6], dtype=F32)
    halves = {} if z_type == "float32" else {"z": z_type, "out": z_type}
    zin = z if z_type == "float32" else to_bf16_bits(z)
    states = {"conv_out": ((s.K - 1, s.conv_dim), F32), "state_out": ((s.Hv, s.Dv, s.Dk), F32)}
    plain = emulate_simt(GDN_STEP, x, {"o": ((1, s.Hv, s.Dv), F32), **states}, template(s), s.Hv * s.Dv // 2, 64,
                         tmp_path)
    normed = emulate_simt(GATED_NORM, {"o": plain["o"], "z": zin, "w": nw, "eps": eps},
                          {"out": ((1, 1, s.Hv * s.Dv), np.uint16 if halves else F32)}, {"OutT": z_type},
                          -(-s.Hv // WPG), WPG * 32, tmp_path, halves=halves)
    fused = emulate_simt(GDN_STEP_GATED, {**x, "z": zin, "nw": nw, "eps": eps},
                         {"out": ((1, 1, s.Hv * s.Dv), np.uint16 if halves else F32), **states},
                         {**template(s), "RPG": rpg, "OutT": z_type}, s.Hv, rpg * 32, tmp_path, halves=halves)
    np.testing.assert_array_equal(fused["out"], normed["out"])
    np.testing.assert_array_equal(fused["state_out"], plain["state_out"])
    np.testing.assert_array_equal(fused["conv_out"], plain["conv_out"])
    o, _, S = OpsCore().step(s, *twin_args(x))  # and the step itself against its twin
    assert maxdiff(plain["o"], o) <= 1e-5
    assert maxdiff(plain["state_out"], S) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [2, 5, 40])
def test_chain_body_equals_twins(shape, n, rng, tmp_path):
    s = SHAPES[shape]
    x = random_layer(rng, s, n)
    w, qkv, a, b, conv, S = twin_args(x)
    g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
    y, _ = ops.causal_conv(qkv, conv, w.conv)
    q, k, v = split_heads(s, y)
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": S}
    out = emulate(GDN_CHAIN, {name: np.array(a) for name, a in inputs.items()},
                  {"o": ((n, s.Hv, s.Dv), F32), "state_out": ((s.Hv, s.Dv, s.Dk), F32)}, template(s), **launch(s),
                  tmp=tmp_path)
    o, _, S_T = OpsCore().chain(s, *twin_args(x))  # the chunked dense form
    o_seq, S_seq = sequential(q, k, v, g, beta, S)  # token by token, the definition
    for theirs, ours in ((o, out["o"]), (o_seq, out["o"]), (S_T, out["state_out"]), (S_seq, out["state_out"])):
        assert maxdiff(ours, theirs) <= 1e-4


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("kind", "n"), [("chain", 1), ("chain", 6), ("star", 7), ("random", 12), ("random", 30)])
def test_tree_body_equals_twin(shape, kind, n, rng, tmp_path):
    s = SHAPES[shape]
    tree = a_tree(rng, kind, n)
    x = random_layer(rng, s, n)
    batch = tree_batch(tree, 5, s.K)

    gdn = batch.gdn or TreeInputs(mx.array(ops.tree_conv_taps(tree.parents, s.K)), ops.tree_masks(tree.ancestor_mask()),
                                  mx.array(tree.dfs_order), mx.array(tree.depths), 1)
    w, qkv, a, b, conv, S = twin_args(x)
    g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
    q, k, v = split_heads(s, ops.tree_conv(qkv, conv, w.conv, gdn.conv_taps))
    inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": S, "order": gdn.dfs_order, "depth": gdn.depths}
    out = emulate(GDN_TREE, {name: np.array(a) for name, a in inputs.items()},
                  {"o": ((n, s.Hv, s.Dv), F32), "u": ((n, s.Hv, s.Dv), F32)},
                  template(s, MAXD=gdn.levels), **launch(s), tmp=tmp_path)
    o, rows = OpsCore().tree(s, *twin_args(x), gdn)
    assert maxdiff(out["o"], o) <= 1e-4
    assert maxdiff(out["u"], rows.u) <= 1e-4


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("kind", "n"), [("chain", 2), ("star", 7), ("random", 12), ("random", 30)])
def test_tree_front_body_equals_twin(shape, kind, n, rng, tmp_path):
    s = SHAPES[shape]
    tree = a_tree(rng, kind, n)
    x = random_layer(rng, s, n)
    gdn = tree_batch(tree, 5, s.K).gdn
    inputs = {**x, "taps": np.array(gdn.conv_taps)}
    rows = n * s.Hv
    out = emulate(GDN_TREE_FRONT, inputs,
                  {"q": ((n, s.Hv, s.Dk), F32), "k": ((n, s.Hv, s.Dk), F32), "v": ((n, s.Hv, s.Dv), F32),
                   "g": ((n, s.Hv), F32), "beta": ((n, s.Hv), F32)},
                  template(s), groups=-(-rows // 2), threads=2, tmp=tmp_path)
    w, qkv, a, b, conv, _ = twin_args(x)
    g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
    q, k, v = split_heads(s, ops.tree_conv(qkv, conv, w.conv, gdn.conv_taps))
    for name, twin in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        # relative to the values: the log-decays reach ~20, where 1e-5 is a few float32 ulps of
        # expf / logf against MLX's exp / log (a random seed failed an absolute 1e-5 by 1.4e-6)
        assert maxdiff(out[name], twin) <= 1e-5 * max(1.0, float(np.abs(np.asarray(twin)).max())), name


@pytest.mark.parametrize("shape", SHAPES)
def test_commit_body_equals_twin(shape, rng, tmp_path):
    s = SHAPES[shape]
    tree = a_tree(rng, "random", 12)
    x = random_layer(rng, s, 12)
    _, rows = OpsCore().tree(s, *twin_args(x), tree_batch(tree, 5, s.K).gdn)
    for leaf in (0, 3, 11):
        path = np.array(tree.path_to(leaf), dtype=np.int32)
        inputs = {"x": x["qkv"], "k": np.array(rows.k), "u": np.array(rows.u), "g": np.array(rows.g), "path": path,
                  "conv_state": x["conv_state"], "state": x["state"]}
        out = emulate(GDN_COMMIT, inputs, {"conv_out": ((s.K - 1, s.conv_dim), F32),
                                           "state_out": ((s.Hv, s.Dv, s.Dk), F32)}, template(s), **launch(s),
                      tmp=tmp_path)
        conv, S = OpsCore().commit(rows, mx.array(path), mx.array(x["conv_state"]), mx.array(x["state"]))
        assert maxdiff(out["conv_out"], conv) == 0.0
        assert maxdiff(out["state_out"], S) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("kind", "n", "prev_kind", "leaf"),
                         [("chain", 6, "random", 0), ("random", 12, "random", 5), ("star", 7, "random", 8),
                          ("random", 30, "random", 8), ("chain", 9, "chain", 7), ("random", 12, "chain", 11)])
def test_fold_bodies_equal_twin(shape, kind, n, prev_kind, leaf, rng, tmp_path):
    """The verify builds with the last round's commit folded in (the path to `leaf` in a tree of
    at least 9 nodes, padded with -1 as the kernel core pads it: chains of 8 and 12 nodes fill one
    batch of the fold's loads and start a second) against OpsCore.tree_after and against the
    commit then the tree, which is what they replace."""
    s = SHAPES[shape]
    prev_n = max(9, leaf + 1)
    prev_tree, prev = a_tree(rng, prev_kind, prev_n), random_layer(rng, s, prev_n)
    _, prev_rows = OpsCore().tree(s, *twin_args(prev), tree_batch(prev_tree, 5, s.K).gdn)
    nodes = tuple(prev_tree.path_to(leaf))
    path = AcceptedPath(nodes).padded_index
    assert path.shape[0] >= len(nodes) and all(int(i) == -1 for i in np.array(path)[len(nodes):])
    tree, x = a_tree(rng, kind, n), random_layer(rng, s, n)
    gdn = tree_batch(tree, 5 + len(nodes), s.K).gdn
    r = {"x_prev": prev["qkv"], "k_prev": np.array(prev_rows.k), "u_prev": np.array(prev_rows.u),
         "g_prev": np.array(prev_rows.g), "path": np.array(path)}
    front = emulate(GDN_TREE_FRONT_FOLD, {**x, "conv_state": prev["conv_state"], "taps": np.array(gdn.conv_taps),
                                          "x_prev": r["x_prev"], "path": r["path"]},
                    {"q": ((n, s.Hv, s.Dk), F32), "k": ((n, s.Hv, s.Dk), F32), "v": ((n, s.Hv, s.Dv), F32),
                     "g": ((n, s.Hv), F32), "beta": ((n, s.Hv), F32), "conv_out": ((s.K - 1, s.conv_dim), F32)},
                    template(s), groups=-(-(n * s.Hv) // 2), threads=2, tmp=tmp_path)
    inputs = {**{k: front[k] for k in ("q", "k", "v", "g", "beta")}, "state": prev["state"],
              "order": np.array(gdn.dfs_order), "depth": np.array(gdn.depths), **r}
    out = emulate(GDN_TREE_FOLD, inputs, {"o": ((n, s.Hv, s.Dv), F32), "u": ((n, s.Hv, s.Dv), F32),
                                          "state_out": ((s.Hv, s.Dv, s.Dk), F32)},
                  template(s, MAXD=gdn.levels), **launch(s), tmp=tmp_path)
    w, qkv, a, b, _, _ = twin_args(x)
    conv0, S0 = mx.array(prev["conv_state"]), mx.array(prev["state"])
    o, rows, conv, S = OpsCore().tree_after(s, w, qkv, a, b, conv0, S0, gdn, Fold(prev_rows, path))
    conv_c, S_c = OpsCore().commit(prev_rows, mx.array(nodes, dtype=mx.int32), conv0, S0)
    o_c, rows_c = OpsCore().tree(s, w, qkv, a, b, conv_c, S_c, gdn)
    # the padding's steps add exact zeros (a BLAS may still sum a longer product in another order)
    assert maxdiff(conv, conv_c) == 0.0 and maxdiff(S, S_c) <= 1e-6
    assert maxdiff(o, o_c) <= 1e-6 and maxdiff(rows.u, rows_c.u) <= 1e-6
    assert maxdiff(front["conv_out"], conv) == 0.0
    for name, twin in (("k", rows.k), ("g", rows.g)):
        assert maxdiff(front[name], twin) <= 1e-5 * max(1.0, float(np.abs(np.asarray(twin)).max())), name
    assert maxdiff(out["state_out"], S) <= 1e-5
    assert maxdiff(out["o"], o) <= 1e-4
    assert maxdiff(out["u"], rows.u) <= 1e-4
