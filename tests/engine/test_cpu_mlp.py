"""The CPU's MLP-block operation (engine/cpu_ext.cpp mlp_block) against the same block in MLX's
operations on random inputs (h = x + out; h + down(SiLU(gate(n)) * up(n)), n = h's RMS norm): close
to float32 rounding, one row's result the same bits whatever the other rows of the call (a decode
step's row and a verify's: with bfloat16 copies of the weights from one row on, as the shim's
products are; without, from two); and a model's
decode and verify rows through it give speculation plain decoding's tokens (test_lossless runs
with it on)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext, half_weights

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_ext.module() is None,
                                reason="the engine's CPU operations are built on Linux with a C++ compiler")


class Owner:
    """Something for registrations to live as long as."""


def block_in_ops(x, out, norm_w, gate_w, up_w, down_w, eps):
    h = x + out
    n = mx.fast.rms_norm(h, norm_w, eps)
    g, u = n @ gate_w.T, n @ up_w.T
    return h + (g * mx.sigmoid(g) * u) @ down_w.T


@pytest.mark.parametrize("registered", [False, True], ids=["float32", "bf16-copies"])
@pytest.mark.parametrize(("H", "I"), [(64, 160), (384, 768), (100, 37)])
def test_equals_the_ops_and_rows_do_not_depend_on_each_other(H, I, registered, monkeypatch):
    rng = np.random.default_rng(H + I)

    def weight(*shape):
        w = mx.array((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))
        return w.astype(mx.bfloat16).astype(mx.float32) if registered else w

    norm_w, gate_w, up_w, down_w = mx.array(rng.uniform(0.5, 1.5, H).astype(np.float32)), weight(I, H), weight(I, H), \
        weight(H, I)
    owner = Owner()
    if registered:
        monkeypatch.setattr(half_weights, "MIN_ELEMENTS", 1)  # small ones too
        assert half_weights.register(owner, [gate_w, up_w, down_w]) == 3
    x = mx.array(rng.standard_normal((1, 17, H)).astype(np.float32))
    out = mx.array(rng.standard_normal((1, 17, H)).astype(np.float32))
    got = np.array(cpu_ext.mlp_block(x, out, norm_w, gate_w, up_w, down_w, 1e-6))
    want = np.array(block_in_ops(x, out, norm_w, gate_w, up_w, down_w, 1e-6))
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, np.abs(want).max()))
    for rows in (1, 2, 7):
        part = np.array(cpu_ext.mlp_block(x[:, :rows], out[:, :rows], norm_w, gate_w, up_w, down_w, 1e-6))
        if rows == 1 and not registered:  # a one-row product by an unregistered weight is OpenBLAS's GEMV
            np.testing.assert_allclose(part, got[:, :1], atol=1e-5 * max(1.0, np.abs(want).max()))
        else:
            assert np.array_equal(part, got[:, :rows]), rows


def test_bad_shapes_are_refused():
    w = mx.zeros((8, 4))
    with pytest.raises(ValueError):
        cpu_ext.mlp_block(mx.zeros((1, 2, 4)), mx.zeros((1, 3, 4)), mx.ones((4,)), w, w, w.T, 1e-6)
    with pytest.raises(ValueError):
        cpu_ext.mlp_block(mx.zeros((1, 2, 4)), mx.zeros((1, 2, 4)), mx.ones((4,)), w, w, w, 1e-6)  # down is [H, I]
