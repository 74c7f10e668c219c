"""KVCache.commit keeps the accepted tree rows, gathered from the verify's own K/V (so the buffer
is updated in place): the result must equal gathering them from the buffer, whatever the path,
also when the last write is not the tree's (the buffer-gather fallback)."""

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import AcceptedPath, KVCache


def filled(context: int, seed: int) -> KVCache:
    rng = np.random.default_rng(seed)
    cache = KVCache()
    k = mx.array(rng.standard_normal((1, 2, context, 8)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, context, 8)).astype(np.float32))
    cache.write(k, v)
    cache.advance(context)
    return cache


def expected(before: np.ndarray, tree: np.ndarray, offset: int, nodes: tuple[int, ...]) -> np.ndarray:
    out = before[:, :, :offset].copy()
    return np.concatenate([out, tree[:, :, list(nodes)]], axis=2)


@pytest.mark.parametrize("nodes", [(0, 2, 5), (0, 1, 2), (0,), (0, 3, 4, 9, 16), (0, 16)])
@pytest.mark.parametrize("context", [5, 300])
def test_commit_keeps_the_accepted_rows(nodes: tuple[int, ...], context: int) -> None:
    cache = filled(context, seed=context)
    before_k = np.array(cache.keys[:, :, :context])
    rng = np.random.default_rng(1)
    tree_k = rng.standard_normal((1, 2, 17, 8)).astype(np.float32)
    tree_v = rng.standard_normal((1, 2, 17, 8)).astype(np.float32)
    cache.write(mx.array(tree_k), mx.array(tree_v))
    cache.commit(AcceptedPath(nodes))
    assert cache.offset == context + len(nodes)
    got = np.array(cache.keys[:, :, : cache.offset])
    np.testing.assert_array_equal(got, expected(before_k, tree_k, context, nodes))
    assert np.array_equal(np.array(cache.values[:, :, context : cache.offset]), tree_v[:, :, list(nodes)])


def test_commit_after_a_write_elsewhere_gathers_from_the_buffer() -> None:
    """Rows written at the offset, then more rows past them: the last write is not the tree's, so
    the commit reads the buffer (the rows at offset + node)."""
    cache = filled(10, seed=3)
    rng = np.random.default_rng(2)
    tree_k = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    cache.write(mx.array(tree_k), mx.array(tree_k))
    cache.advance(6)
    cache.write(mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32)),
                mx.array(rng.standard_normal((1, 2, 3, 8)).astype(np.float32)))
    cache.rewind(10)
    cache.commit(AcceptedPath((0, 2, 5)))
    np.testing.assert_array_equal(np.array(cache.keys[:, :, 10:13]), tree_k[:, :, [0, 2, 5]])
