"""The engine's own CPU attention (engine/cpu_ext.cpp rows_attention) against its twin in MLX's
operations (attention_ops), and the invariances that let a verify row equal the decode step that
sees the same keys: a row's result depends only on the keys it sees, in order, not on the other
rows of the call, their number, or where its tree keys sit in the cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext, kv_int8
from engine.models import layers
from engine.models.layers import attention_ops
from engine.tree import DraftTree

pytestmark = pytest.mark.skipif(cpu_ext.module() is None,
                                reason="engine/cpu_ext.cpp not built here (no C++ compiler, headers or nanobind)")


def arr(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32))


def tree_mask(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, n] ancestors-or-self of a random tree in topological order (each node's parent earlier)."""
    return DraftTree(tuple(range(n)), (-1, *(int(rng.integers(0, i)) for i in range(1, n)))).ancestor_mask()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (2, 1, 32), (4, 4, 128), (8, 1, 16), (16, 2, 256)])
@pytest.mark.parametrize("keys", [1, 7, 511, 512, 513, 1500])
def test_one_row_equals_the_ops(heads, kv_heads, dim, keys, rng):
    """A decode step's row, over a view of a longer cache buffer (as KVCache hands it out)."""
    q = arr(rng.normal(size=(1, heads, 1, dim)) * 2)
    kbuf, vbuf = (arr(rng.normal(size=(1, kv_heads, keys + 37, dim))) for _ in range(2))
    k, v = kbuf[:, :, :keys], vbuf[:, :, :keys]
    got = cpu_ext.rows_attention(q, k, v, dim**-0.5, keys)
    want = attention_ops(q, k, v, dim**-0.5)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("prefix", "nodes"), [(0, 5), (3, 17), (600, 9), (1100, 33)])
def test_tree_rows_equal_the_ops(prefix, nodes, rng):
    q = arr(rng.normal(size=(1, 6, nodes, 64)) * 2)
    k, v = arr(rng.normal(size=(1, 2, prefix + nodes, 64))), arr(rng.normal(size=(1, 2, prefix + nodes, 64)))
    seen = tree_mask(rng, nodes)
    got = cpu_ext.rows_attention(q, k, v, 0.125, prefix, mx.array(seen))
    mask = np.concatenate([np.ones((nodes, prefix), dtype=bool), seen], axis=1)
    want = attention_ops(q, k, v, 0.125, mx.array(mask))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(("prefix", "nodes"), [(2, 6), (700, 17), (1030, 12)])
def test_a_tree_row_is_bitwise_the_step_over_its_keys(prefix, nodes, rng):
    """Each row of a verify equals, bit for bit, one row over the keys it sees laid out as plain
    decoding commits them (the prefix, then its ancestors and itself, contiguous), alone in its call."""
    q = rng.normal(size=(1, 6, nodes, 64)).astype(np.float32)
    k = rng.normal(size=(1, 2, prefix + nodes, 64)).astype(np.float32)
    v = rng.normal(size=(1, 2, prefix + nodes, 64)).astype(np.float32)
    seen = tree_mask(rng, nodes)
    tree = np.array(cpu_ext.rows_attention(arr(q), arr(k), arr(v), 0.125, prefix, mx.array(seen)))
    for i in range(nodes):
        path = np.concatenate([np.arange(prefix), prefix + np.nonzero(seen[i])[0]])
        step = cpu_ext.rows_attention(arr(q[:, :, i : i + 1]), arr(k[:, :, path]), arr(v[:, :, path]), 0.125, len(path))
        assert np.array_equal(np.array(step)[:, :, 0], tree[:, :, i]), f"row {i}"


def test_rows_do_not_depend_on_each_other(rng):
    """The same rows in a call of 9 rows and of 3, in another order: the same bits."""
    q = rng.normal(size=(1, 6, 9, 64)).astype(np.float32)
    k, v = (arr(rng.normal(size=(1, 2, 1300, 64))) for _ in range(2))
    seen = rng.random((9, 4)) < 0.5
    seen[:, 0] = True
    nine = np.array(cpu_ext.rows_attention(arr(q), k, v, 0.125, 1296, mx.array(seen)))
    pick = [7, 2, 4]
    three = np.array(cpu_ext.rows_attention(arr(q[:, :, pick]), k, v, 0.125, 1296, mx.array(seen[pick])))
    assert np.array_equal(three, nine[:, :, pick])


@pytest.mark.parametrize("kv", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (2, 1, 32), (4, 4, 128), (8, 1, 16), (16, 2, 256)])
@pytest.mark.parametrize(("prefix", "nodes"), [(1, 0), (1500, 0), (0, 5), (700, 17)])
def test_a_half_cache_reads_as_its_float32_copy(kv, heads, kv_heads, dim, prefix, nodes, rng):
    """Keys and values stored as halves (KVCache.dtype, --kv-dtype) are widened in the load: the
    same bits as the float32 operation over their float32 copies, for a decode row (nodes = 0) and
    a verify's rows, over a view of a longer buffer and over a transposed (non-contiguous) copy.
    Small, subnormal and large values included."""
    rows = max(1, nodes)
    q = arr(rng.normal(size=(1, heads, rows, dim)) * 2)
    scales = rng.choice([1e-6, 1e-2, 1.0, 100.0], size=(1, kv_heads, prefix + nodes + 9, dim))
    kbuf, vbuf = (mx.array((rng.normal(size=scales.shape) * scales).astype(np.float32)).astype(kv) for _ in range(2))
    k, v = kbuf[:, :, : prefix + nodes], vbuf[:, :, : prefix + nodes]
    seen = mx.array(tree_mask(rng, nodes)) if nodes else None
    got = cpu_ext.rows_attention(q, k, v, dim**-0.5, prefix, seen)
    want = cpu_ext.rows_attention(q, k.astype(mx.float32), v.astype(mx.float32), dim**-0.5, prefix, seen)
    assert np.array_equal(np.array(got), np.array(want))
    strided = mx.array(np.array(k.astype(mx.float32)).transpose(0, 1, 3, 2)).astype(kv).transpose(0, 1, 3, 2)
    assert np.array_equal(np.array(cpu_ext.rows_attention(q, strided, v, dim**-0.5, prefix, seen)), np.array(want))
    # each key row loaded once a query head (KV_HEADS_TOGETHER off: scores16, the twin of scores16_heads)
    apart = cpu_ext.module().rows_attention(q, k, v, dim**-0.5, prefix, seen, False)
    assert np.array_equal(np.array(apart), np.array(want))


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (2, 1, 32), (4, 4, 128), (8, 1, 16), (16, 2, 256)])
@pytest.mark.parametrize(("prefix", "nodes"), [(1, 0), (1500, 0), (0, 5), (700, 17)])
def test_an_8_bit_cache_reads_as_its_float32_copy(heads, kv_heads, dim, prefix, nodes, rng):
    """Keys and values stored as 8-bit rows with their scales (--kv-dtype int8, engine/kv_int8.py)
    are read in place: the same bits as the float32 operation over their unpacked copies, for a
    decode row and a verify's rows, over a view of a longer buffer and over a non-contiguous copy,
    with the keys loaded once for all query heads or once a head. Rows of very different scales."""
    rows = max(1, nodes)
    q = arr(rng.normal(size=(1, heads, rows, dim)) * 2)
    scales = rng.choice([1e-6, 1e-2, 1.0, 100.0], size=(1, kv_heads, prefix + nodes + 9, 1))
    kbuf, vbuf = (kv_int8.pack(arr(rng.normal(size=(1, kv_heads, prefix + nodes + 9, dim)) * scales)) for _ in range(2))
    k, v = kbuf[:, :, : prefix + nodes], vbuf[:, :, : prefix + nodes]
    seen = mx.array(tree_mask(rng, nodes)) if nodes else None
    want = np.array(cpu_ext.rows_attention(q, kv_int8.unpack(k), kv_int8.unpack(v), dim**-0.5, prefix, seen))
    assert np.array_equal(np.array(cpu_ext.rows_attention(q, k, v, dim**-0.5, prefix, seen)), want)
    apart = cpu_ext.module().rows_attention(q, k, v, dim**-0.5, prefix, seen, False)
    assert np.array_equal(np.array(apart), want)
    strided = mx.array(np.array(k).transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    assert np.array_equal(np.array(cpu_ext.rows_attention(q, strided, v, dim**-0.5, prefix, seen)), want)
    with pytest.raises(ValueError, match="shapes do not match"):  # an 8-bit row carries its scale
        cpu_ext.rows_attention(q, k[..., :dim], v[..., :dim], dim**-0.5, prefix, seen)


def test_bad_shapes_are_refused(rng):
    q = arr(rng.normal(size=(1, 6, 2, 64)))
    k = arr(rng.normal(size=(1, 2, 10, 64)))
    cpu_ext.rows_attention(q, k, k, 0.125, 10)  # rows that see every key need no mask
    with pytest.raises(ValueError, match="shapes"):
        cpu_ext.rows_attention(q, k, k, 0.125, 8)  # without a mask the rows see every key
    with pytest.raises(ValueError, match="shapes"):
        cpu_ext.rows_attention(q, k, k, 0.125, 11, mx.ones((2, 0), dtype=mx.bool_))
    with pytest.raises(ValueError, match="seen"):
        cpu_ext.rows_attention(q, k, k, 0.125, 8, mx.ones((2, 3), dtype=mx.bool_))
    with pytest.raises(ValueError, match="float32"):
        cpu_ext.rows_attention(q.astype(mx.float16), k, k, 0.125, 10)
    with pytest.raises(ValueError, match="the same"):  # a half cache's keys and values share a type
        cpu_ext.rows_attention(q, k.astype(mx.float16), k, 0.125, 10)
    with pytest.raises(ValueError, match="the same"):
        cpu_ext.rows_attention(q, k.astype(mx.int32), k.astype(mx.int32), 0.125, 10)
    assert not cpu_ext.supports(3, 48) and cpu_ext.supports(3, 64)


@pytest.mark.parametrize(("uses", "switch", "rows"), [(layers.cpu_rows_attention, "ATTENTION", 1),
                                                     (layers.cpu_causal_attention, "CAUSAL", 8)])
def test_the_layers_use_it_where_it_is_built(uses, switch, rows, monkeypatch, rng):
    """A decode step and a verify (rows_attention), a prefill chunk (causal_attention) attend
    through the operation on the CPU; switched off, through MLX's operations."""
    q = arr(rng.normal(size=(1, 6, rows, 64)))
    k = arr(rng.normal(size=(1, 2, 100, 64)))
    assert uses(q, k)
    monkeypatch.setattr(cpu_ext, switch, False)
    assert not uses(q, k)
    monkeypatch.setattr(cpu_ext, switch, True)
    assert not uses(q.astype(mx.bfloat16), k)  # float32 only
    assert not uses(arr(rng.normal(size=(1, 6, rows, 48))), arr(rng.normal(size=(1, 2, 9, 48))))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_ext.OPT_OUT, "0")
    assert cpu_ext._open() is None


@pytest.mark.parametrize(("cap", "length", "rows", "j"), [(64, 1, 8, 0), (512, 300, 8, 5), (2048, 2048, 16, 15)])
def test_a_drafted_row_equals_the_ops(cap, length, rows, j, monkeypatch, rng):
    """The MTP head's drafted row (engine/models/mtp.py scratch_attention) through draft_attention
    and through the operations, over a committed buffer with garbage past `length` and a scratch
    with garbage past row j."""
    from engine.models import mtp

    q = arr(rng.normal(size=(1, 6, 1, 64)) * 2)
    keys, values = (arr(rng.normal(size=(1, 2, cap, 64))) for _ in range(2))
    skeys, svalues = (arr(rng.normal(size=(1, 2, rows, 64))) for _ in range(2))
    n, at = mx.array(length, dtype=mx.int32), mx.array(j, dtype=mx.int32)
    got = mtp.scratch_attention(q, keys, values, n, skeys, svalues, at, 0.125)
    monkeypatch.setattr(cpu_ext, "ATTENTION", False)
    want = mtp.scratch_attention(q, keys, values, n, skeys, svalues, at, 0.125)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)


def test_a_mask_view_is_read_by_its_strides(rng):
    q = arr(rng.normal(size=(1, 6, 5, 64)))
    k, v = (arr(rng.normal(size=(1, 2, 20, 64))) for _ in range(2))
    seen = tree_mask(rng, 5)
    wide = np.zeros((5, 9), dtype=bool)
    wide[:, 2:7] = seen
    view = mx.array(wide)[:, 2:7]  # the same mask as a strided view of a wider one
    got = cpu_ext.rows_attention(q, k, v, 0.125, 15, view)
    want = cpu_ext.rows_attention(q, k, v, 0.125, 15, mx.array(seen))
    assert np.array_equal(np.array(got), np.array(want))


@pytest.mark.parametrize(("cap", "length", "block"), [(64, 1, 16), (512, 300, 16), (4096, 4000, 16), (256, 37, 5)])
def test_a_block_of_drafted_rows_equals_the_ops(cap, length, block, rng):
    """A DFlash block's rows through draft_attention: each row over the context's first `length`
    rows (garbage past them) and every row of the block, against the operations with that mask."""
    q = arr(rng.normal(size=(1, 6, block, 64)) * 2)
    keys, values = (arr(rng.normal(size=(1, 2, cap, 64))) for _ in range(2))
    bkeys, bvalues = (arr(rng.normal(size=(1, 2, block, 64))) for _ in range(2))
    got = cpu_ext.draft_attention(q, keys, values, mx.array([length], dtype=mx.int32), bkeys, bvalues,
                                  mx.array(block - 1, dtype=mx.int32), 0.125)
    mask = np.concatenate([np.arange(cap) < length, np.ones(block, dtype=bool)])[None].repeat(block, 0)
    want = attention_ops(q, mx.concatenate([keys, bkeys], axis=2), mx.concatenate([values, bvalues], axis=2),
                         0.125, mx.array(mask))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)
    # a row alone gives the same bits as among the block's
    one = cpu_ext.draft_attention(q[:, :, 3:4], keys, values, mx.array([length], dtype=mx.int32), bkeys, bvalues,
                                  mx.array(block - 1, dtype=mx.int32), 0.125)
    assert np.array_equal(np.array(one)[:, :, 0], np.array(got)[:, :, 3])


def test_a_dflash_block_attends_in_the_operation(tiny_dflash, monkeypatch, rng):
    """The tiny DFlash drafter's block with the attention operation (counted) and without it (the
    split form in MLX's operations): the same final hidden states within float32 rounding."""
    from engine.loader import load_dflash

    model = load_dflash(tiny_dflash)
    c = model.config
    cache = model.make_cache()
    model.append_context(mx.array(rng.normal(size=(40, len(c.target_layer_ids) * c.hidden_size)).astype(np.float32)),
                         cache)
    block = arr(rng.normal(size=(1, c.block_size, c.hidden_size)))
    calls = []
    real = cpu_ext.draft_attention
    monkeypatch.setattr(cpu_ext, "draft_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    with_op = np.array(model.block(block, cache))
    assert calls and calls[0][2] == c.block_size
    monkeypatch.setattr(cpu_ext, "ATTENTION", False)
    without = np.array(model.block(block, cache))
    np.testing.assert_allclose(with_op, without, rtol=1e-4, atol=2e-5)
