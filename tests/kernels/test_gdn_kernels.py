"""The GDN kernels against their twins (OpsCore, and the per-node reference), on fresh random
inputs of realistic shapes and on trees of many shapes. Needs a GPU backend: skipped elsewhere.
The recorded H200 runs are in metal/README.md."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import AcceptedPath
from engine.gdn.core import Fold, GDNShape, GDNWeights, OpsCore, TreeInputs, split_heads
from engine.gdn.ops import causal_conv, gates, tree_conv
from engine.gdn.reference import sequential, tree_sequential
from engine.kernels import KernelCore, gpu_backend
from engine.tree import DraftTree

pytestmark = pytest.mark.skipif(gpu_backend() is None, reason="needs a GPU backend (Metal or CUDA)")

SHAPES = {
    "bundled": GDNShape(Hk=6, Hv=12, Dk=32, Dv=32, K=4),
    "9b": GDNShape(Hk=16, Hv=32, Dk=128, Dv=128, K=4),
    "0.8b": GDNShape(Hk=16, Hv=16, Dk=128, Dv=128, K=4),
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


def kernels() -> KernelCore:
    backend = gpu_backend()
    assert backend is not None
    return KernelCore(backend)


def inputs(rng: np.random.Generator, s: GDNShape, n: int, dtype) -> tuple:
    """Projected rows and states scaled like a real layer's."""
    def arr(x, dt=dtype):
        return mx.array(x.astype(np.float32)).astype(dt)

    qkv = arr(rng.normal(size=(n, s.conv_dim)))
    a, b = arr(rng.normal(size=(n, s.Hv))), arr(rng.normal(size=(n, s.Hv)))
    conv_state = arr(rng.normal(size=(s.K - 1, s.conv_dim)))
    w = GDNWeights(conv=arr(rng.normal(size=(s.conv_dim, s.K)) * 0.5), A_log=arr(rng.normal(size=s.Hv), mx.float32),
                   dt_bias=arr(rng.normal(size=s.Hv)))
    S = arr(rng.normal(size=(s.Hv, s.Dv, s.Dk)) * 0.3, mx.float32)
    return qkv, a, b, conv_state, w, S


def close(x, y, tol: float) -> float:
    d = float(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max())
    scale = max(1.0, float(mx.abs(y.astype(mx.float32)).max()))
    assert d <= tol * scale, f"max |diff| {d} (scale {scale})"
    return d


def tree_of(shape: str, n: int, rng: np.random.Generator) -> DraftTree:
    if shape == "chain":
        parents = [-1, *range(n - 1)]
    elif shape == "star":
        parents = [-1] + [0] * (n - 1)
    elif shape == "chain+siblings":  # what the draft-chain drafter builds
        depth = min(n - 1, 8)
        parents = [-1, *range(depth)] + [int(rng.integers(0, depth)) for _ in range(n - 1 - depth)]
    else:
        parents = [-1] + [int(rng.integers(i)) for i in range(1, n)]
    return DraftTree(tuple(range(n)), tuple(parents))


def tree_inputs(tree: DraftTree, K: int) -> TreeInputs:
    from engine.forward import tree_batch

    gdn = tree_batch(tree, 7, K).gdn
    if gdn is None:  # one node: build the arrays the same way
        from engine.gdn import ops

        gdn = TreeInputs(mx.array(ops.tree_conv_taps(tree.parents, K)), ops.tree_masks(tree.ancestor_mask()),
                         mx.array(tree.dfs_order), mx.array(tree.depths), 1)
    return gdn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_step_equals_twin(shape, dtype, rng):
    s = SHAPES[shape]
    qkv, a, b, conv, w, S = inputs(rng, s, 1, DTYPES[dtype])
    fast = kernels().step(s, w, qkv, a, b, conv, S)
    with mx.stream(mx.cpu):
        slow = OpsCore().step(s, w, qkv, a, b, conv, S)
    close(fast[0], slow[0], 1e-4)
    assert fast[1].dtype == conv.dtype and mx.array_equal(fast[1], slow[1])
    close(fast[2], slow[2], 1e-4)
    assert np.array_equal(np.array(S), np.array(S))  # the committed state is an input only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("warps", [32, 16, 8])
def test_gated_step_is_the_step_then_the_gated_norm(shape, dtype, warps, rng, monkeypatch):
    """The step with the output's gated norm in one launch: bitwise the two launches, z as the fused
    projection hands it over (a column slice of its row)."""
    import engine.kernels as kernel_module
    from engine import fused_norms

    monkeypatch.setattr(kernel_module, "GATED_STEP_WARPS", warps)
    s, dt = SHAPES[shape], DTYPES[dtype]
    qkv, a, b, conv, w, S = inputs(rng, s, 1, dt)
    row = mx.array(rng.normal(size=(1, s.conv_dim + s.value_dim + 7)).astype(np.float32) * 2).astype(dt)
    z = row[:, s.conv_dim:s.conv_dim + s.value_dim]
    nw = mx.array((rng.normal(size=(s.Dv,)) * 0.1 + 1).astype(np.float32)).astype(dt)
    core = kernels()
    assert core.step_gated_covers(s, qkv, conv, z, nw)
    out, conv_g, S_g = core.step_gated(s, w, qkv, a, b, conv, S, z, nw, 1e-6)
    o, conv_p, S_p = core.step(s, w, qkv, a, b, conv, S)
    want = fused_norms.gated_norm(o, z, nw, 1e-6)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert mx.array_equal(out, want) and mx.array_equal(conv_g, conv_p) and mx.array_equal(S_g, S_p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [2, 17, 512])
def test_chain_equals_twins(shape, dtype, n, rng):
    s = SHAPES[shape]
    qkv, a, b, conv, w, S = inputs(rng, s, n, DTYPES[dtype])
    S_before = np.array(S)
    o, conv_k, S_k = kernels().chain(s, w, qkv, a, b, conv, S)
    with mx.stream(mx.cpu):  # the twins in exact fp32 (GPU matmuls may round through TF32)
        o_ref, conv_ref, S_ref = OpsCore().chain(s, w, qkv, a, b, conv, S)
        g, beta = gates(a, b, w.A_log, w.dt_bias)
        q, k, v = split_heads(s, causal_conv(qkv, conv, w.conv)[0])
        o_seq, S_seq = sequential(q, k, v, g, beta, S)
    assert conv_k.dtype == conv.dtype and mx.array_equal(conv_k, conv_ref)
    close(o, o_seq, 2e-4)
    close(S_k, S_seq, 2e-4)
    close(o, o_ref, 1e-3)  # the chunked form rounds differently over long chains
    close(S_k, S_ref, 1e-3)
    assert np.array_equal(S_before, np.array(S))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("tree_shape", "n"), [("chain", 1), ("chain", 2), ("chain", 17), ("star", 9),
                                               ("chain+siblings", 17), ("chain+siblings", 33), ("random", 33),
                                               ("random", 64), ("chain", 33)])
def test_tree_equals_twins(shape, dtype, tree_shape, n, rng):
    s = SHAPES[shape]
    tree = tree_of(tree_shape, n, rng)
    qkv, a, b, conv, w, S = inputs(rng, s, n, DTYPES[dtype])
    gdn = tree_inputs(tree, s.K)
    S_before = np.array(S)
    o, rows = kernels().tree(s, w, qkv, a, b, conv, S, gdn)
    with mx.stream(mx.cpu):  # the twins in exact fp32 (GPU matmuls may round through TF32)
        o_ref, rows_ref = OpsCore().tree(s, w, qkv, a, b, conv, S, gdn)
        g, beta = gates(a, b, w.A_log, w.dt_bias)
        q, k, v = split_heads(s, tree_conv(qkv, conv, w.conv, gdn.conv_taps))
        o_seq, u_seq = tree_sequential(q, k, v, g, beta, tree.parents, S)  # node by node, the definition
    close(o, o_ref, 2e-4)
    close(rows.u, rows_ref.u, 2e-4)
    close(rows.k, rows_ref.k, 1e-5)
    close(rows.g, rows_ref.g, 1e-5)
    close(o, o_seq, 2e-4)
    close(rows.u, u_seq, 2e-4)
    assert np.array_equal(S_before, np.array(S))  # rollback-free: the committed state is never written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_commit_equals_twin(shape, dtype, rng):
    s = SHAPES[shape]
    tree = tree_of("chain+siblings", 17, rng)
    qkv, a, b, conv, w, S = inputs(rng, s, 17, DTYPES[dtype])
    _, rows = OpsCore().tree(s, w, qkv, a, b, conv, S, tree_inputs(tree, s.K))
    for leaf in (0, 1, 5, 12, 16):
        path = mx.array(tree.path_to(leaf), dtype=mx.int32)
        conv_k, S_k = kernels().commit(rows, path, conv, S)
        with mx.stream(mx.cpu):
            conv_o, S_o = OpsCore().commit(rows, path, conv, S)
        assert conv_k.dtype == conv.dtype and mx.array_equal(conv_k, conv_o)
        close(S_k, S_o, 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("tree_shape", "n"), [("chain", 2), ("chain+siblings", 17), ("random", 33)])
def test_tree_after_equals_twins(shape, dtype, tree_shape, n, rng):
    """The verify with the last round's commit folded in (two kernels) against OpsCore.tree_after
    and against the commit kernel followed by the tree kernels; the states it is given unchanged."""
    s = SHAPES[shape]
    prev_tree = tree_of("chain+siblings", 17, rng)
    qkv0, a0, b0, conv, w, S = inputs(rng, s, 17, DTYPES[dtype])
    _, prev = kernels().tree(s, w, qkv0, a0, b0, conv, S, tree_inputs(prev_tree, s.K))
    tree = tree_of(tree_shape, n, rng)
    qkv, a, b, *_ = inputs(rng, s, n, DTYPES[dtype])
    gdn = tree_inputs(tree, s.K)
    S_before, conv_before = np.array(S), np.array(conv.astype(mx.float32))
    for leaf in (0, 2, 9, 16):
        nodes = tuple(prev_tree.path_to(leaf))
        fold = Fold(prev, AcceptedPath(nodes).padded_index)
        o, rows, conv_k, S_k = kernels().tree_after(s, w, qkv, a, b, conv, S, gdn, fold)
        conv_c, S_c = kernels().commit(prev, mx.array(nodes, dtype=mx.int32), conv, S)
        o_c, rows_c = kernels().tree(s, w, qkv, a, b, conv_c, S_c, gdn)
        with mx.stream(mx.cpu):
            o_ref, rows_ref, conv_ref, S_ref = OpsCore().tree_after(s, w, qkv, a, b, conv, S, gdn, fold)
        assert conv_k.dtype == conv.dtype and mx.array_equal(conv_k, conv_ref) and mx.array_equal(conv_k, conv_c)
        close(S_k, S_ref, 1e-4)
        close(S_k, S_c, 1e-5)  # the same arithmetic as the commit kernel
        close(o, o_ref, 2e-4)
        close(rows.u, rows_ref.u, 2e-4)
        close(o, o_c, 1e-5)
        close(rows.u, rows_c.u, 1e-5)
        close(rows.k, rows_ref.k, 1e-5)
    assert np.array_equal(S_before, np.array(S)) and np.array_equal(conv_before, np.array(conv.astype(mx.float32)))


def test_the_model_picks_the_kernels_on_cuda(tiny_qwen35):
    from engine.loader import load_model

    core = load_model(tiny_qwen35).model.core
    assert isinstance(core, KernelCore) == (gpu_backend() == "cuda")  # Metal: opt-in (engine/kernels.py)
