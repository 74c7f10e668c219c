"""The one-row attention in ops (used on the CPU over long caches) against the fused kernel, and
the decode of a long cache through either equal; the two-part attention (a DFlash block over its
context buffer) against the fused kernel over the concatenated keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext
from engine.models import layers
from engine.models.layers import attention_ops, attention_parts, one_row_in_ops


@pytest.mark.parametrize(("heads", "kv_heads", "keys"), [(6, 2, 1), (6, 2, 700), (4, 4, 33), (8, 1, 300)])
def test_ops_equal_the_fused_kernel(heads, kv_heads, keys):
    rng = np.random.default_rng(keys)
    q = mx.array(rng.normal(size=(1, heads, 1, 64)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(1, kv_heads, keys, 64)).astype(np.float32)) for _ in range(2))
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    np.testing.assert_allclose(np.array(attention_ops(q, k, v, 0.125)), np.array(fused), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "ctx", "rows"), [(6, 2, 256, 16), (4, 4, 1, 3), (8, 1, 512, 5)])
def test_two_parts_equal_the_fused_kernel_over_the_concatenation(heads, kv_heads, ctx, rows):
    rng = np.random.default_rng(ctx + rows)

    def arr(*shape):
        return mx.array(rng.normal(size=shape).astype(np.float32))

    q = arr(1, heads, rows, 64)
    k0, v0 = arr(1, kv_heads, ctx, 64), arr(1, kv_heads, ctx, 64)
    k1, v1 = arr(1, kv_heads, rows, 64), arr(1, kv_heads, rows, 64)
    mask = rng.random((rows, ctx + rows)) < 0.6
    mask[:, -1] = True  # every row sees a key
    mask = mx.array(mask)
    fused = mx.fast.scaled_dot_product_attention(q, mx.concatenate([k0, k1], axis=2), mx.concatenate([v0, v1], axis=2),
                                                 scale=0.125, mask=mask)
    got = attention_parts(q, (k0, k1), (v0, v1), 0.125, mask)
    np.testing.assert_allclose(np.array(got), np.array(fused), rtol=1e-5, atol=1e-6)


def test_only_long_caches_on_the_cpu_take_the_ops():
    on_cpu = mx.default_device() == mx.cpu
    assert one_row_in_ops(layers.OPS_ATTENTION_FROM) == on_cpu
    assert not one_row_in_ops(layers.OPS_ATTENTION_FROM - 1)


def test_decode_is_the_same_through_either(tiny_qwen35, monkeypatch):
    from engine.config import EngineConfig, SamplingParams
    from engine.generate import Engine
    from tests.helpers import generate

    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefix_cache=False))
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 200, size=40)]
    sampling = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
    monkeypatch.setattr(layers, "OPS_ATTENTION_FROM", 10**9)
    fused = generate(engine, prompt, sampling).tokens
    monkeypatch.setattr(layers, "OPS_ATTENTION_FROM", 1)
    ops = generate(engine, prompt, sampling).tokens
    assert ops == fused



@pytest.mark.parametrize(("heads", "kv_heads", "ctx", "rows"), [(6, 2, 0, 16), (6, 2, 300, 64), (8, 1, 40, 7)])
def test_a_causal_chunk_in_ops_equals_the_fused_kernel(heads, kv_heads, ctx, rows):
    """A prefill chunk's rows (the last `rows` of the keys) under the causal mask, in ops (the CPU's
    way with a fast BLAS) and fused."""
    rng = np.random.default_rng(ctx + rows)
    q = mx.array(rng.normal(size=(1, heads, rows, 64)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(1, kv_heads, ctx + rows, 64)).astype(np.float32)) for _ in range(2))
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = attention_ops(q, k, v, 0.125, layers.causal_mask(rows, ctx + rows))
    np.testing.assert_allclose(np.array(got), np.array(fused), rtol=1e-5, atol=1e-6)


def test_chunks_in_ops_only_on_the_cpu_and_while_the_scores_stay_small():
    fast_cpu = mx.default_device() == mx.cpu and layers.FAST_BLAS
    assert layers.chunk_in_ops(512 * 4000 * 6) == fast_cpu
    assert not layers.chunk_in_ops(layers.CHUNK_OPS_SCORES + 1)


def test_prefill_is_the_same_through_either(tiny_qwen35, monkeypatch):
    """The caches after a chunked prefill, chunks attending in ops or fused, agree (fp32)."""
    from engine import cpu_ext, forward
    from engine.loader import load_model

    monkeypatch.setattr(cpu_ext, "CAUSAL", False)  # neither way: the engine's own operation
    model = load_model(tiny_qwen35, "float32").model
    ids = [int(t) for t in np.random.default_rng(1).integers(1, 200, size=90)]
    states = {}
    for name, ops in (("ops", True), ("fused", False)):
        monkeypatch.setattr(layers, "chunk_in_ops", lambda scores, ops=ops: ops)
        cache = model.make_cache()
        forward.extend(model, cache, ids, chunk=32)
        states[name] = [np.array(a) for c in cache for a in c.arrays()]
    for a, b in zip(states["ops"], states["fused"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("rows", "tree"), [(1, False), (5, False), (7, True)])
@pytest.mark.parametrize("offset", [0, 3000, "array"])
def test_rope_of_q_and_k_together_is_bitwise_the_rope_of_each(rows, tree, offset):
    """apply_rope_pair (one rope call over q and k stacked on the CPU) against two calls: per head
    the same arithmetic, so the same bits, for a chain at an int or array offset and for a verify's
    rows at their own positions."""
    rng = np.random.default_rng(rows)
    q = mx.array(rng.normal(size=(1, 6, rows, 64)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, 2, rows, 64)).astype(np.float32))
    rope = layers.RopeSpec(16, 1e7)
    off = mx.array(211, dtype=mx.int32) if offset == "array" else offset
    batch = layers.CHAIN
    if tree:
        positions = mx.array(rng.integers(0, 4000, size=rows).astype(np.int32))
        batch = layers.Batch(deferred=True, positions=positions)
    got_q, got_k = layers.apply_rope_pair(q, k, rope, off, batch)
    want_q, want_k = (layers.apply_rope(t, rope, off, batch) for t in (q, k))
    assert np.array_equal(np.array(got_q), np.array(want_q))
    assert np.array_equal(np.array(got_k), np.array(want_k))


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("offset", [0, 195, 4000, "array", "positions"])
def test_the_cpu_rope_compiled_is_bitwise_mlx_rope(rows, offset, monkeypatch):
    """apply_rope on the CPU without the engine's own operation (tests/engine/test_cpu_rope.py) runs
    MLX's rope compiled (its ~30 eager operations fused); each row's rotation is bitwise the eager
    one's, at an int offset, an array offset and a verify's positions."""
    monkeypatch.setattr(cpu_ext, "ROPE", False)
    rng = np.random.default_rng(rows)
    x = mx.array(rng.normal(size=(1, 6, rows, 64)).astype(np.float32))
    rope = layers.RopeSpec(16, 1e7)
    if offset == "positions":
        positions = mx.array(rng.integers(0, 4000, size=rows).astype(np.int32))
        got = layers.apply_rope(x, rope, 0, layers.Batch(deferred=True, positions=positions))
        want = mx.fast.rope(x.swapaxes(0, 2), 16, traditional=False, base=1e7, scale=1.0,
                            offset=positions).swapaxes(0, 2)
    else:
        off = mx.array(211, dtype=mx.int32) if offset == "array" else offset
        got = layers.apply_rope(x, rope, off, layers.CHAIN)
        want = mx.fast.rope(x, 16, traditional=False, base=1e7, scale=1.0, offset=211 if offset == "array" else offset)
    assert np.array_equal(np.array(got), np.array(want))
