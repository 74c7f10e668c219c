"""The engine's own CPU attention for a prefill chunk (engine/cpu_ext.cpp causal_attention) against
a float64 reference and its twin in MLX's operations (attention_ops under the causal mask), and the
invariance that makes chunking invisible: a row's result depends only on its query and the keys up
to its own, not on the chunk or the block of rows that holds it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext, forward
from engine.loader import load_model
from engine.models.layers import attention_ops, causal_mask

pytestmark = pytest.mark.skipif(cpu_ext.module() is None,
                                reason="engine/cpu_ext.cpp not built here (no C++ compiler, headers or nanobind)")


def arr(x: np.ndarray) -> mx.array:
    return mx.array(x.astype(np.float32))


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """float64: q [1, H, T, D] as the last T positions of k, v [1, Hkv, L, D]."""
    H, T, L, Hkv = q.shape[1], q.shape[2], k.shape[2], k.shape[1]
    kk, vv = (np.repeat(a, H // Hkv, axis=1).astype(np.float64) for a in (k, v))
    s = q.astype(np.float64) @ kk.swapaxes(-1, -2) * scale
    s = np.where(np.arange(L)[None, :] <= np.arange(L - T, L)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ vv


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 64), (2, 1, 32), (4, 4, 128), (8, 1, 16), (16, 2, 256)])
@pytest.mark.parametrize(("rows", "keys"), [(1, 1), (2, 2), (17, 17), (16, 700), (33, 64), (100, 1000), (512, 512)])
def test_chunk_rows_equal_float64_and_the_ops(heads, kv_heads, dim, rows, keys, rng):
    """Over a view of a longer cache buffer (as KVCache hands it out), key counts around the tiles'
    and the row blocks' sizes."""
    q = rng.normal(size=(1, heads, rows, dim)).astype(np.float32) * 2
    kbuf = rng.normal(size=(1, kv_heads, keys + 29, dim)).astype(np.float32) * 2
    vbuf = rng.normal(size=(1, kv_heads, keys + 29, dim)).astype(np.float32)
    k, v = arr(kbuf)[:, :, :keys], arr(vbuf)[:, :, :keys]
    got = np.array(cpu_ext.causal_attention(arr(q), k, v, dim**-0.5))
    np.testing.assert_allclose(got, reference(q, kbuf[:, :, :keys], vbuf[:, :, :keys], dim**-0.5),
                               rtol=2e-5, atol=5e-6)
    # MLX's operations round further from float64 than the tiles do (over 12 seeds: 2.3e-6 past
    # rtol against 1.3e-5 at 256 dimensions)
    want = attention_ops(arr(q), k, v, dim**-0.5, causal_mask(rows, keys))
    np.testing.assert_allclose(got, np.array(want), rtol=2e-5, atol=4e-5)


def test_a_row_is_the_same_in_any_chunk(rng):
    """Rows computed in one chunk, in smaller chunks, alone, and as the last rows of a shorter key
    list (a prompt's tail after a prefix-cache hit): the same bits."""
    q = rng.normal(size=(1, 6, 100, 64)).astype(np.float32) * 3
    k = rng.normal(size=(1, 2, 300, 64)).astype(np.float32) * 3
    v = rng.normal(size=(1, 2, 300, 64)).astype(np.float32)
    whole = np.array(cpu_ext.causal_attention(arr(q), arr(k), arr(v), 0.125))  # positions 200..299
    for lo, hi in ((70, 100), (99, 100), (20, 60), (0, 1), (5, 37)):
        end = 200 + hi  # the chunk's keys end at its last row
        part = cpu_ext.causal_attention(arr(q[:, :, lo:hi]), arr(k[:, :, :end]), arr(v[:, :, :end]), 0.125)
        assert np.array_equal(np.array(part), whole[:, :, lo:hi]), (lo, hi)


def test_far_keys_and_a_growing_maximum(rng):
    """Scores spread over hundreds (a tile's maximum far above the running one, and far below):
    entries ~2^-125 of the largest weigh as little as in float64, none is lost or doubled."""
    q = rng.normal(size=(1, 2, 40, 64)).astype(np.float32) * 8
    k = rng.normal(size=(1, 1, 400, 64)).astype(np.float32) * 8
    k[:, :, 350:] *= 4  # later tiles raise the running maximum
    v = rng.normal(size=(1, 1, 400, 64)).astype(np.float32)
    got = np.array(cpu_ext.causal_attention(arr(q), arr(k), arr(v), 0.125))
    want = reference(q, k, v, 0.125)
    assert np.isfinite(got).all()
    # scores of a few hundred carry float32's rounding (~3e-5 of a weight) whatever computes them:
    # held near MLX's operations' own distance from float64 (over 40 seeds: at most 5.2e-5, and 0.34x
    # the operations' distance in the median, 2.2x at worst)
    ops = np.array(attention_ops(arr(q), arr(k), arr(v), 0.125, causal_mask(40, 400)))
    assert np.abs(got - want).max() <= max(3 * np.abs(ops - want).max(), 1e-4)


def test_bad_inputs_are_refused(rng):
    q = arr(rng.normal(size=(1, 6, 4, 64)))
    k = arr(rng.normal(size=(1, 2, 10, 64)))
    with pytest.raises(ValueError, match="shapes"):
        cpu_ext.causal_attention(q, k[:, :, :3], k[:, :, :3], 0.125)  # fewer keys than rows
    with pytest.raises(ValueError, match="shapes"):
        cpu_ext.causal_attention(arr(rng.normal(size=(1, 6, 4, 48))), arr(rng.normal(size=(1, 2, 9, 48))),
                                 arr(rng.normal(size=(1, 2, 9, 48))), 0.125)
    with pytest.raises(ValueError, match="shapes"):
        cpu_ext.causal_attention(arr(rng.normal(size=(1, 5, 4, 64))), k, k, 0.125)  # heads not a multiple
    with pytest.raises(ValueError, match="float32"):
        cpu_ext.causal_attention(q.astype(mx.float16), k, k, 0.125)


def test_a_prefill_through_it_agrees_with_the_ops(tiny_qwen35, monkeypatch):
    """The caches and the next token's logits after a chunked prefill of the tiny Qwen3.5, the chunks
    attending in the operation (counted) or in MLX's operations (fp32)."""
    model = load_model(tiny_qwen35, "float32").model
    ids = [int(t) for t in np.random.default_rng(2).integers(1, 200, size=150)]
    calls = []
    real = cpu_ext.causal_attention
    monkeypatch.setattr(cpu_ext, "causal_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    states = {}
    for name, on in (("operation", True), ("ops", False)):
        monkeypatch.setattr(cpu_ext, "CAUSAL", on)
        cache = model.make_cache()
        forward.extend(model, cache, ids[:-1], chunk=64)
        logits = model(mx.array([ids[-1:]]), cache)  # the next token's, over the prefilled cache
        states[name] = [np.array(logits)] + [np.array(a) for c in cache for a in c.arrays()]
    assert calls and all(shape[2] > 1 for shape in calls)
    for a, b in zip(states["operation"], states["ops"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
