"""How the caches' buffers grow: KV_STEP rows at a time for a drafter's cache, by a share of the
context for the target's (engine/cache.py grown_capacity), the rows written kept either way."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine.cache import GROWTH, KV_STEP, AcceptedPath, KVCache, grown_capacity
from engine.feature_cache import FeatureCache, FeatureTaps


def test_capacity_rule():
    assert grown_capacity(1, 0, headroom=True) == KV_STEP
    assert grown_capacity(KV_STEP + 1, 0, headroom=True) == 2 * KV_STEP
    assert grown_capacity(4 * KV_STEP, 0, headroom=True) == 5 * KV_STEP  # a restored prefix: slack after it
    assert grown_capacity(4 * KV_STEP, 0, headroom=False) == 4 * KV_STEP
    assert grown_capacity(KV_STEP + 1, KV_STEP, headroom=False) == 2 * KV_STEP
    held = 128 * KV_STEP  # 32k rows
    grown = grown_capacity(held + 1, held, headroom=True)
    assert grown >= held + held // GROWTH and grown % KV_STEP == 0
    assert grown_capacity(held + 1, held, headroom=False) == held + KV_STEP
    assert grown_capacity(3 * held, held, headroom=True) == 3 * held  # a long write: what it needs


def _decode(cache: KVCache, rows: int, rng: np.random.Generator) -> tuple[int, np.ndarray]:
    """Write `rows` one-row steps; -> how many times the buffer was replaced, the rows written."""
    grown, buffer, written = 0, None, []
    for _ in range(rows):
        k = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
        cache.write(mx.array(k), mx.array(-k))
        cache.commit(AcceptedPath((0,)))
        grown += cache.keys is not buffer
        buffer = cache.keys
        written.append(k)
    return grown, np.concatenate(written, axis=2)


def test_the_targets_kv_grows_rarely_and_keeps_its_rows():
    steps, steady = KVCache(), KVCache(headroom=True)
    rows = 12 * KV_STEP
    grown_steps, k = _decode(steps, rows, np.random.default_rng(1))
    grown_share, k2 = _decode(steady, rows, np.random.default_rng(1))
    assert grown_steps == 12  # one copy of the whole context every KV_STEP rows
    assert grown_share == 8  # buffers of 256, 512, 640, 1024, 1280, 1792, 2304 and 3072 rows
    for cache in (steps, steady):
        assert cache.offset == rows
        np.testing.assert_array_equal(np.array(cache.keys[:, :, :rows]), k)
        np.testing.assert_array_equal(np.array(cache.values[:, :, :rows]), -k)
    np.testing.assert_array_equal(k, k2)


def test_a_restored_prefix_leaves_room_for_its_request():
    """A prefix cache hit restores the prompt's rows into a fresh cache: the target's has room for
    what follows (its first decode step copied the whole context again before), a drafter's not."""
    rows = 4 * KV_STEP
    k = mx.array(np.random.default_rng(3).standard_normal((1, 2, rows, 8)).astype(np.float32))
    full = KVCache(headroom=True)
    full.write(k, k)
    full.advance(rows)
    snap = full.snapshot(rows)
    for headroom, cap in ((True, 5 * KV_STEP), (False, rows)):
        cache = KVCache(headroom=headroom)
        cache.restore(snap, rows)
        assert cache.keys.shape[2] == cap
        np.testing.assert_array_equal(np.array(cache.keys[:, :, :rows]), np.array(k))


def test_the_feature_rows_grow_by_a_share_too():
    cache = FeatureCache(FeatureTaps(final=True))
    replaced, buffer = 0, None
    for i in range(8 * KV_STEP):
        cache.record(mx.full((1, 4), float(i)), deferred=False)
        replaced += cache.rows is not buffer
        buffer = cache.rows
    assert replaced < 8
    np.testing.assert_array_equal(np.array(cache.read(0))[:, 0], np.arange(8 * KV_STEP, dtype=np.float32))
