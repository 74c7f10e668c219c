"""The 8-bit K/V cache's rows (engine/kv_int8.py) and the cache that stores them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import kv_int8
from engine.cache import AcceptedPath, KVCache


def test_a_row_is_its_values_to_half_a_step_of_its_scale():
    """Each row gets its own scale (its largest magnitude / 127), stored after its values; an
    element comes back within half a step of that scale, the row's largest exactly, and a row of
    zeros as zeros."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 7, 64)).astype(np.float32) * rng.choice([1e-5, 1.0, 300.0], size=(1, 2, 7, 1))
    x[0, 1, 3] = 0.0
    packed = kv_int8.pack(mx.array(x))
    assert packed.dtype == mx.int8 and packed.shape == (1, 2, 7, 68)
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127
    back = np.array(kv_int8.unpack(packed))
    assert np.all(np.abs(back - x) <= scale * 0.5 * (1 + 1e-5) + 1e-30)
    top = np.abs(x).argmax(axis=-1)[..., None]
    np.testing.assert_allclose(np.take_along_axis(back, top, -1), np.take_along_axis(x, top, -1), rtol=1e-6)
    assert not back[0, 1, 3].any()
    np.testing.assert_allclose(np.array(packed[..., 64:]).view(np.float32)[..., 0],
                               np.where(scale > 0, scale, 1.0)[..., 0], rtol=1e-6)


def test_unpack_is_the_elements_times_their_scale_in_float32():
    """What every reader computes (the CPU's attention in place, the others after unpack): an
    element's int8 value times its row's float32 scale, one rounded product."""
    rng = np.random.default_rng(1)
    packed = np.array(kv_int8.pack(mx.array(rng.normal(size=(3, 32)).astype(np.float32))))
    want = packed[:, :32].astype(np.float32) * packed[:, 32:].copy().view(np.float32)
    assert np.array_equal(np.array(kv_int8.unpack(mx.array(packed))), want)
    assert kv_int8.unpack(mx.array(packed), mx.bfloat16).dtype == mx.bfloat16


@pytest.mark.parametrize("headroom", [False, True])
def test_an_8_bit_cache_quantizes_each_row_once(headroom):
    """KVCache(dtype=int8): rows packed as they are written, kept through growth and a tree's
    commit, and a snapshot restored into a fresh cache as it was (not packed again)."""
    rng = np.random.default_rng(2)
    cache = KVCache(mx.int8, headroom=headroom)
    rows = [mx.array(rng.normal(size=(1, 2, n, 16)).astype(np.float32)) for n in (5, 300, 1)]
    for r in rows:
        keys, values = cache.write(r, r * 2)
        cache.advance(r.shape[2])
    assert keys.dtype == mx.int8 and keys.shape == (1, 2, 306, 20)
    want = mx.concatenate([kv_int8.pack(r) for r in rows], axis=2)
    assert np.array_equal(np.array(keys), np.array(want))
    tree = mx.array(rng.normal(size=(1, 2, 4, 16)).astype(np.float32))
    cache.write(tree, tree)
    cache.commit(AcceptedPath((0, 2)))
    kept = kv_int8.pack(tree)[:, :, mx.array([0, 2])]
    assert np.array_equal(np.array(cache.keys[:, :, 306:308]), np.array(kept))
    fresh = KVCache(mx.int8)
    fresh.restore(cache.snapshot(308), 308)
    assert np.array_equal(np.array(fresh.keys[:, :, :308]), np.array(cache.keys[:, :, :308]))
    wide = KVCache(mx.float16)  # packed rows into a cache of another dtype: their values
    wide.restore(cache.snapshot(308), 308)
    assert wide.keys.dtype == mx.float16
    assert np.array_equal(np.array(wide.keys[:, :, :308]),
                          np.array(kv_int8.unpack(cache.keys[:, :, :308]).astype(mx.float16)))
