"""The engine's own CPU softmax (engine/cpu_ext.cpp softmax_rows) against its twin in MLX's
operations (engine/cpu_exp.py softmax_rows with the switch off) and a float64 reference: masked
entries, -inf entries, row lengths around the 16 lanes, masks read through strides, and a row's
result independent of the other rows of the call."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_exp, cpu_ext
from engine.models.layers import attention_parts

pytestmark = pytest.mark.skipif(cpu_ext.module() is None,
                                reason="engine/cpu_ext.cpp not built here (no C++ compiler, headers or nanobind)")


def reference(x: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    s = x.astype(np.float64)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def in_ops(x: mx.array, mask: mx.array | None, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setattr(cpu_ext, "SOFTMAX", False)
        return np.array(cpu_exp.softmax_rows(x, mask))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 100, 4112])
@pytest.mark.parametrize("masked", [False, True])
def test_rows_equal_the_ops_and_float64(length, masked, rng, monkeypatch):
    x = rng.normal(size=(2, 3, 5, length)).astype(np.float32) * 6
    if length > 1:
        x[0, 1, 2, 0] = -np.inf  # an entry already masked in the scores
    mask = rng.random((5, length)) < 0.7 if masked else None
    if mask is not None:
        mask[:, -1] = True  # every row sees an entry
    xa, ma = mx.array(x), None if mask is None else mx.array(mask)
    got = np.array(cpu_exp.softmax_rows(xa, ma))
    np.testing.assert_allclose(got, reference(x, mask), rtol=2e-6, atol=1e-9)
    # MLX's sums over a long row round further from float64 than the 16 lanes do (6e-6 at 4,112)
    np.testing.assert_allclose(got, in_ops(xa, ma, monkeypatch), rtol=1e-5, atol=1e-9)
    if mask is not None:
        assert not got[..., ~mask].any()  # a dropped entry weighs exactly 0
    assert length == 1 or got[0, 1, 2, 0] == 0.0
    # a row sums to 1 as closely as its entries match float64 (rtol 2e-6 above); summed in float64
    # so the check's own float32 rounding (10 ulp over 4,112 entries, seen once) does not count
    np.testing.assert_allclose(got.astype(np.float64).sum(axis=-1), 1.0, rtol=2e-6)


def test_a_row_does_not_depend_on_the_others(rng):
    """The same row alone, among others, and in another position of the call: the same bits."""
    rows = rng.normal(size=(9, 300)).astype(np.float32) * 4
    alone = np.array(cpu_ext.softmax_rows(mx.array(rows[4:5])))
    together = np.array(cpu_ext.softmax_rows(mx.array(rows)))
    shuffled = np.array(cpu_ext.softmax_rows(mx.array(rows[::-1].copy())))
    assert (alone[0] == together[4]).all() and (together[4] == shuffled[4]).all()


def test_views_and_a_broadcast_mask(rng):
    """Non-contiguous scores (a transpose) and a mask read through its strides (a column slice
    and a broadcast row) give what their dense copies give."""
    x = mx.array(rng.normal(size=(4, 40, 3)).astype(np.float32)).transpose(0, 2, 1)  # [4, 3, 40], strided
    wide = rng.random((3, 80)) < 0.6
    wide[:, 0] = True
    mask = mx.array(wide)[:, ::2]
    dense = np.array(cpu_ext.softmax_rows(mx.array(np.array(x)), mx.array(np.array(mask))))
    np.testing.assert_array_equal(np.array(cpu_ext.softmax_rows(x, mask)), dense)
    row = np.ones((1, 40), dtype=bool)
    row[0, 5:9] = False
    got = np.array(cpu_ext.softmax_rows(x, mx.broadcast_to(mx.array(row), (3, 40))))
    np.testing.assert_allclose(got, reference(np.array(x), np.broadcast_to(row, (3, 40))), rtol=2e-6, atol=1e-9)


def test_far_below_the_maximum_weighs_nothing():
    """Entries more than ~87 below the row's largest (2^-125 of its weight) weigh 0, as float32's
    exp rounds them to (nearly) nothing next to a sum of at least 1."""
    x = mx.array(np.array([[0.0, -50.0, -86.0, -90.0, -1e30]], dtype=np.float32))
    got = np.array(cpu_ext.softmax_rows(x))[0]
    want = reference(np.array(x), None)[0]
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-5)  # 4e-38: a few bits short of a normal float
    assert got[3] <= 1e-37 and got[4] == 0.0


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="float32"):
        cpu_ext.softmax_rows(mx.zeros((2, 3), dtype=mx.float16))
    with pytest.raises(ValueError, match="mask"):
        cpu_ext.softmax_rows(mx.zeros((2, 3)), mx.ones((3, 2), dtype=mx.bool_))


def test_attention_in_parts_with_the_operation_and_without(rng, monkeypatch):
    """A DFlash block's attention (engine/models/dflash.py: 16 rows over a context buffer whose
    unused capacity the mask hides, and their own rows) as the operation and as MLX's ops."""
    q = mx.array(rng.normal(size=(1, 6, 16, 64)).astype(np.float32))
    kc, vc = (mx.array(rng.normal(size=(1, 2, 512, 64)).astype(np.float32)) for _ in range(2))
    kb, vb = (mx.array(rng.normal(size=(1, 2, 16, 64)).astype(np.float32)) for _ in range(2))
    mask = np.concatenate([np.arange(512) < 300, np.ones(16, dtype=bool)])[None].repeat(16, axis=0)
    got = np.array(attention_parts(q, (kc, kb), (vc, vb), 0.125, mx.array(mask)))
    with monkeypatch.context() as m:
        m.setattr(cpu_ext, "SOFTMAX", False)
        want = np.array(attention_parts(q, (kc, kb), (vc, vb), 0.125, mx.array(mask)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
