"""The one-row attention in ops (used on the CPU over long caches) against the fused kernel, the
decode of a long cache through either equal, and the softmax the ops form uses."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.models import layers
from engine.models.layers import attention_ops, one_row_in_ops


@pytest.mark.parametrize(("heads", "kv_heads", "keys"), [(6, 2, 1), (6, 2, 700), (4, 4, 33), (8, 1, 300)])
def test_ops_equal_the_fused_kernel(heads, kv_heads, keys):
    rng = np.random.default_rng(keys)
    q = mx.array(rng.normal(size=(1, heads, 1, 64)).astype(np.float32))
    k, v = (mx.array(rng.normal(size=(1, kv_heads, keys, 64)).astype(np.float32)) for _ in range(2))
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    np.testing.assert_allclose(np.array(attention_ops(q, k, v, 0.125)), np.array(fused), rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("pow_softmax", [True, False])
def test_softmax_rows_equals_mx_softmax_with_masked_entries(pow_softmax, monkeypatch):
    """The softmax the ops attention uses (through a power of two on the CPU) against mx.softmax,
    on random scores with masked (-inf) entries, rows that see a single key included."""
    monkeypatch.setattr(layers, "POW_SOFTMAX", pow_softmax)
    rng = np.random.default_rng(5)
    scores = rng.normal(size=(2, 7, 300)).astype(np.float32) * 6
    seen = rng.random(size=scores.shape) < 0.7
    seen[:, 0, :] = False
    seen[:, :, 0] = True  # every row sees at least one key; row 0 sees that one only
    x = mx.where(mx.array(seen), mx.array(scores), -mx.inf)
    ours, ref = np.array(layers.softmax_rows(x)), np.array(mx.softmax(x, axis=-1))
    assert np.abs(ours - ref).max() <= 1e-6
    assert np.all(ours[~seen] == 0.0) and np.allclose(ours.sum(axis=-1), 1.0, atol=1e-6)
    assert np.all(ours[:, 0, 0] == 1.0)
