"""The CPU's norm-and-products operation (engine/cpu_ext.cpp norm_products) against the operations it
stands for (the RMS norm operation, then a matmul a weight), on random inputs: bitwise the same
outputs (the same norm arithmetic and the same BLAS calls), with and without a norm, with weights
registered as bfloat16 copies or not, at 1 to 40 rows; and layers.norm_then takes it on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext, half_weights
from engine.models import layers
from engine.models.linear import Linear

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_ext.module() is None,
                                reason="the engine's CPU operations are built on Linux with a C++ compiler")


class Owner:
    """Something for registrations to live as long as."""


@pytest.mark.parametrize("registered", [False, True], ids=["float32", "bf16-copies"])
@pytest.mark.parametrize("normed", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_bitwise_the_norm_and_the_matmuls(rows, normed, registered, monkeypatch):
    rng = np.random.default_rng(rows)
    K, sizes = 96, (200, 64, 6)
    weights = [mx.array((rng.standard_normal((n, K)) / np.sqrt(K)).astype(np.float32)) for n in sizes]
    if registered:
        weights = [w.astype(mx.bfloat16).astype(mx.float32) for w in weights]
        monkeypatch.setattr(half_weights, "MIN_ELEMENTS", 1)
        owner = Owner()
        assert half_weights.register(owner, weights) == len(weights)
    norm_w = mx.array(rng.uniform(0.5, 1.5, K).astype(np.float32))
    x = mx.array(rng.standard_normal((rows, K)).astype(np.float32))
    got = cpu_ext.norm_products(x, weights, norm_w if normed else None, 1e-6)
    a = cpu_ext.rms_norm(x, norm_w, 1e-6) if normed else x
    for g, w in zip(got, weights, strict=True):
        assert g.shape == (rows, w.shape[0])
        assert np.array_equal(np.array(g), np.array(a @ w.T))


def test_norm_then_takes_it_on_the_cpu(monkeypatch):
    rng = np.random.default_rng(3)
    mods = [Linear(32, n, bias=False) for n in (48, 16)]
    norm = layers.RMSNorm(32, 1e-6)
    x = mx.array(rng.standard_normal((5, 32)).astype(np.float32))
    assert layers.cpu_products(x, mods)
    got = layers.norm_then(x, mods, norm)
    monkeypatch.setattr(cpu_ext, "PRODUCTS", False)
    assert not layers.cpu_products(x, mods)
    for g, w in zip(got, layers.norm_then(x, mods, norm), strict=True):
        assert np.array_equal(np.array(g), np.array(w))
    assert not layers.cpu_products(x, [Linear(32, 8, bias=True)])  # a bias: the operations


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        cpu_ext.norm_products(mx.zeros((2, 8)), [mx.zeros((4, 9))])
    with pytest.raises(ValueError):
        cpu_ext.norm_products(mx.zeros((2, 8)), [mx.zeros((4, 8))], mx.ones((7,)), 1e-6)
    with pytest.raises(ValueError):
        cpu_ext.norm_products(mx.zeros((2, 8)), [])
