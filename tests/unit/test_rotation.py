"""The block Hadamard rotation is the orthogonal matrix D H (blocks of 32), its inverse undoes it,
and a RotatedLinear holding W R computes what the Linear holding W did, also compiled."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import rotation


def _explicit(n: int) -> np.ndarray:
    """D H as a dense matrix: Sylvester Hadamard of 32 on the diagonal blocks, row-scaled by the signs."""
    h = np.array([[1.0]])
    while h.shape[0] < rotation.BLOCK:
        h = np.block([[h, h], [h, -h]])
    h /= np.sqrt(rotation.BLOCK)
    H = np.kron(np.eye(n // rotation.BLOCK), h)
    return np.diag(np.array(rotation.signs(n))) @ H


@pytest.mark.parametrize("n", [32, 96, 384])
def test_rotate_is_x_times_D_H(n):
    x = np.random.default_rng(n).standard_normal((5, n)).astype(np.float32)
    R = _explicit(n)
    np.testing.assert_allclose(R @ R.T, np.eye(n), atol=1e-6)
    np.testing.assert_allclose(np.array(rotation.rotate(mx.array(x), rotation.signs(n))), x @ R, atol=1e-5)
    back = rotation.unrotate(rotation.rotate(mx.array(x), rotation.signs(n)), rotation.signs(n))
    np.testing.assert_allclose(np.array(back), x, atol=1e-5)


def test_signs_are_fixed_per_size_and_need_blocks_of_32():
    assert mx.array_equal(rotation.signs(64), rotation.signs(64))
    assert not mx.array_equal(rotation.signs(64), rotation.signs(128)[:64])
    assert set(np.array(rotation.signs(64)).tolist()) == {-1.0, 1.0}
    with pytest.raises(ValueError, match="divisible by 32"):
        rotation.signs(60)


@pytest.mark.parametrize("quantized", [False, True])
def test_rotated_linear_computes_the_original(quantized):
    mx.random.seed(0)
    plain = nn.Linear(128, 64, bias=False)
    rotated = rotation.RotatedLinear(128, 64)
    rotated.input_signs = rotation.signs(128)
    rotated.weight = rotation.rotate(plain.weight, rotated.input_signs)  # W R
    if quantized:
        plain, rotated = plain.to_quantized(group_size=32, bits=8), rotated.to_quantized(group_size=32, bits=8)
        assert isinstance(rotated, rotation.RotatedQuantizedLinear)
    x = mx.random.normal((3, 128))
    tol = 5e-2 if quantized else 1e-5
    np.testing.assert_allclose(np.array(rotated(x)), np.array(plain(x)), atol=tol)
    np.testing.assert_allclose(np.array(mx.compile(rotated)(x)), np.array(rotated(x)), atol=1e-5)
