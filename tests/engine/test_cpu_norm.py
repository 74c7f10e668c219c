"""The CPU's own RMS norm (engine/cpu_ext.cpp rms_norm) against mx.fast.rms_norm, and a row's
result independent of the other rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext

pytestmark = pytest.mark.skipif(cpu_ext.module() is None,
                                reason="engine/cpu_ext.cpp not built here (no C++ compiler, headers or nanobind)")


@pytest.mark.parametrize("shape", [(1, 1, 384), (1, 7, 384), (1, 3, 6, 64), (5, 33), (2, 16)])
def test_equals_mlx(shape, rng):
    x = mx.array((rng.normal(size=shape) * 3).astype(np.float32))
    w = mx.array(rng.normal(size=shape[-1]).astype(np.float32))
    np.testing.assert_allclose(np.array(cpu_ext.rms_norm(x, w, 1e-6)), np.array(mx.fast.rms_norm(x, w, 1e-6)),
                               rtol=1e-5, atol=1e-6)


def test_a_view_is_read_by_its_strides(rng):
    x = mx.array(rng.normal(size=(1, 6, 5, 64)).astype(np.float32)).transpose(0, 2, 1, 3)
    w = mx.array(rng.normal(size=64).astype(np.float32))
    np.testing.assert_allclose(np.array(cpu_ext.rms_norm(x, w, 1e-6)), np.array(mx.fast.rms_norm(x, w, 1e-6)),
                               rtol=1e-5, atol=1e-6)


def test_rows_are_bitwise_independent(rng):
    x = mx.array(rng.normal(size=(9, 384)).astype(np.float32))
    w = mx.array(rng.normal(size=384).astype(np.float32))
    every = np.array(cpu_ext.rms_norm(x, w, 1e-6))
    for i in (0, 4, 8):
        assert np.array_equal(np.array(cpu_ext.rms_norm(x[i : i + 1], w, 1e-6)), every[i : i + 1])


def test_other_dtypes_and_the_switch_take_mlx(monkeypatch, rng):
    x = mx.array(rng.normal(size=(2, 64)).astype(np.float32))
    w = mx.ones((64,))
    half = cpu_ext.rms_norm(x.astype(mx.bfloat16), w.astype(mx.bfloat16), 1e-6)
    assert half.dtype == mx.bfloat16
    monkeypatch.setattr(cpu_ext, "NORMS", False)
    assert np.array_equal(np.array(cpu_ext.rms_norm(x, w, 1e-6)), np.array(mx.fast.rms_norm(x, w, 1e-6)))
