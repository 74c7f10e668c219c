"""The fused residual add and RMS norm (metal/add_norm.kernel) against its twin: emulated on the
CPU against NumPy (fp32), and on a GPU the MLX call against `x + y` and mx.fast.rms_norm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.add_norm import WPG, add_norm, covers
from engine.kernels import ADD_NORM, gpu_backend
from tests.kernels.emulate import emulate


def reference(x: np.ndarray, y: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    h = (x.astype(np.float64) + y).astype(np.float32)
    rms = np.sqrt((h.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + eps)
    return h, h / rms * w


@pytest.mark.parametrize(("rows", "dims"), [(1, 384), (7, 384), (17, 100)])
def test_emulated_body_equals_twin(rows, dims, rng, tmp_path):
    x = rng.normal(size=(1, rows, dims)).astype(np.float32)
    y = rng.normal(size=(1, rows, dims)).astype(np.float32)
    w = rng.normal(size=(dims,)).astype(np.float32)
    eps = np.array([1e-6], dtype=np.float32)
    got = emulate(ADD_NORM, {"x": x, "y": y, "w": w, "eps": eps},
                  {"h": ((1, rows, dims), np.float32), "out": ((1, rows, dims), np.float32)},
                  {"OutT": "float32"}, -(-rows // WPG), WPG, tmp_path)
    h, out = reference(x, y, w, 1e-6)
    np.testing.assert_array_equal(got["h"], h)  # the add rounds once, as MLX's does
    assert np.abs(got["out"] - out).max() < 1e-5 * max(1.0, np.abs(out).max())
    # a row's result does not depend on the other rows of the launch
    one = emulate(ADD_NORM, {"x": x[:, :1], "y": y[:, :1], "w": w, "eps": eps},
                  {"h": ((1, 1, dims), np.float32), "out": ((1, 1, dims), np.float32)},
                  {"OutT": "float32"}, 1, WPG, tmp_path)
    np.testing.assert_array_equal(one["out"][0, 0], got["out"][0, 0])


def test_covers_rows_of_one_dtype():
    x = mx.zeros((1, 3, 64), dtype=mx.bfloat16)
    assert covers(x, x, mx.ones((64,)))
    assert not covers(x, x.astype(mx.float32), mx.ones((64,)))
    assert not covers(mx.zeros((2, 3, 64)), mx.zeros((2, 3, 64)), mx.ones((64,)))
    assert not covers(x, x, mx.ones((32,)))


@pytest.mark.skipif(gpu_backend() is None, reason="the kernel runs on a GPU backend")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "dims"), [(1, 4096), (17, 4096), (5, 384)])
def test_gpu_kernel_equals_add_and_rms_norm(dtype, rows, dims, rng):
    x = mx.array(rng.normal(size=(1, rows, dims)).astype(np.float32)).astype(dtype)
    y = mx.array(rng.normal(size=(1, rows, dims)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.normal(size=(dims,)).astype(np.float32)).astype(dtype)
    h, out = add_norm(x, y, w, 1e-6)
    assert mx.array_equal(h, x + y)
    want = mx.fast.rms_norm(x + y, w, 1e-6).astype(mx.float32)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(out.astype(mx.float32) - want).max()) <= tol * max(1.0, float(mx.abs(want).max()))


def test_off_by_default_and_without_a_gpu(monkeypatch):
    import engine.add_norm as fused

    monkeypatch.setattr(fused.SWITCH, "value", True)
    assert fused.enabled() == (gpu_backend() is not None)
    monkeypatch.setattr(fused.SWITCH, "value", False)
    assert not fused.enabled()
