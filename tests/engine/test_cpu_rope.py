"""The CPU's RoPE operation (engine/cpu_ext.cpp rope) against RoPE in float64 and MLX's rope on
random inputs: within float32 rounding of float64 (it takes the angles in double), as far from
MLX's as MLX's angles in float32 are from exact,
the dims past the rotated ones untouched; a row's rotation depends only on its position (a chain at
an int or array offset, a verify's rows at their positions, one row or many: bitwise alike); and
the engine's apply_rope takes it on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext
from engine.models import layers

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_ext.module() is None,
                                reason="the engine's CPU operations are built on Linux with a C++ compiler")


def reference(x: mx.array, dims: int, base: float, positions: np.ndarray) -> np.ndarray:
    """RoPE in float64."""
    out = np.array(x).astype(np.float64)
    half = dims // 2
    theta = positions[:, None] * base ** (-np.arange(half) / half)[None]
    a, b = out[..., :half].copy(), out[..., half:dims].copy()
    out[..., :half] = a * np.cos(theta) - b * np.sin(theta)
    out[..., half:dims] = a * np.sin(theta) + b * np.cos(theta)
    return out


@pytest.mark.parametrize(("rows", "offset"), [(1, 0), (7, 195), (40, 4000), (3, 32000)])
@pytest.mark.parametrize(("dims", "head_dim", "base"), [(16, 64, 1e7), (64, 64, 1e4), (32, 128, 1e6)])
def test_close_to_float64_and_to_mlx_rope(rows, offset, dims, head_dim, base):
    rng = np.random.default_rng(rows + dims)
    x = mx.array(rng.normal(size=(1, 3, rows, head_dim)).astype(np.float32))
    got = np.array(cpu_ext.rope(x, dims, base, offset))
    want = reference(x, dims, base, offset + np.arange(rows))
    mlx = np.array(mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0, offset=offset))
    mlx_error = np.abs(mlx - want).max()
    assert np.abs(got - want).max() <= 1e-5  # float32's rounding of the result, not of the angle
    assert np.abs(got - mlx).max() <= mlx_error + 1e-5  # as far from MLX's as MLX's is from exact
    assert np.array_equal(got[..., dims:], np.array(x)[..., dims:])


def test_a_row_is_rotated_by_its_position_alone():
    rng = np.random.default_rng(5)
    x = mx.array(rng.normal(size=(1, 6, 9, 64)).astype(np.float32))
    positions = mx.array(rng.integers(0, 5000, size=9).astype(np.int32))
    many = np.array(cpu_ext.rope(x, 16, 1e7, positions=positions))
    chain = np.array(cpu_ext.rope(x, 16, 1e7, mx.array(311, dtype=mx.int32)))
    for t in range(9):
        one = np.array(cpu_ext.rope(x[:, :, t : t + 1], 16, 1e7, int(positions[t].item())))
        assert np.array_equal(one[:, :, 0], many[:, :, t])
        at = np.array(cpu_ext.rope(x[:, :, t : t + 1], 16, 1e7, positions=positions[t : t + 1]))
        assert np.array_equal(at[:, :, 0], many[:, :, t])
        assert np.array_equal(np.array(cpu_ext.rope(x[:, :, t : t + 1], 16, 1e7, 311 + t))[:, :, 0], chain[:, :, t])


def test_a_transposed_view_is_read_by_its_strides():
    rng = np.random.default_rng(6)
    x = mx.array(rng.normal(size=(1, 5, 4, 32)).astype(np.float32)).transpose(0, 2, 1, 3)  # [1, 4, 5, 32]
    np.testing.assert_array_equal(np.array(cpu_ext.rope(x, 16, 1e4, 9)),
                                  np.array(cpu_ext.rope(mx.array(np.array(x)), 16, 1e4, 9)))


def test_apply_rope_takes_it_on_the_cpu(monkeypatch):
    rng = np.random.default_rng(7)
    q = mx.array(rng.normal(size=(1, 6, 3, 64)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, 2, 3, 64)).astype(np.float32))
    spec = layers.RopeSpec(16, 1e7)
    got_q, got_k = layers.apply_rope_pair(q, k, spec, 40, layers.CHAIN)
    assert np.array_equal(np.array(got_q), np.array(cpu_ext.rope(q, 16, 1e7, 40)))
    assert np.array_equal(np.array(got_k), np.array(cpu_ext.rope(k, 16, 1e7, 40)))
    monkeypatch.setattr(cpu_ext, "ROPE", False)
    np.testing.assert_allclose(np.array(layers.apply_rope(q, spec, 40, layers.CHAIN)), np.array(got_q), atol=1e-4)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        cpu_ext.rope(mx.zeros((2, 64)), 16, 1e4, 0)
    with pytest.raises(ValueError):
        cpu_ext.rope(mx.zeros((1, 2, 3, 8)), 16, 1e4, 0)  # more rotated dims than the head has
    with pytest.raises(ValueError):
        cpu_ext.rope(mx.zeros((1, 2, 3, 64)), 16, 1e4, positions=mx.zeros((2,), dtype=mx.int32))
