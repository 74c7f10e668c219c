"""engine/gdn/ops.py step: one token of the recurrence on split_heads' row layout is bitwise the
per-head formulation it replaced (squeezed rows, indexed head axes), and is the delta rule."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.gdn import ops


def per_head_step(q, k, v, g, beta, S):
    """The step as written before: rows squeezed to [Hv, ...], the head axes indexed apart."""
    q, k, v, g, beta = (x.squeeze(0) for x in (q, k, v, g, beta))
    S = mx.exp(g)[:, None, None] * S
    kv = (S @ k[:, :, None])[..., 0]
    delta = beta[:, None] * (v - kv)
    S = S + delta[:, :, None] * k[:, None, :]
    return (S @ q[:, :, None])[..., 0][None], S


@pytest.mark.parametrize("Hv,Dk,Dv", [(12, 32, 32), (4, 16, 24), (1, 8, 8)])
def test_step_is_bitwise_the_per_head_step_and_the_delta_rule(Hv, Dk, Dv):
    rng = np.random.default_rng(Hv * Dk + Dv)
    q, k = (rng.normal(size=(1, Hv, Dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(1, Hv, Dv)).astype(np.float32)
    g = -rng.uniform(0.01, 2.0, size=(1, Hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(1, Hv)).astype(np.float32)
    S = rng.normal(size=(Hv, Dv, Dk)).astype(np.float32)
    args = [mx.array(x) for x in (q, k, v, g, beta, S)]
    o, S1 = ops.step(*args)
    o_ref, S_ref = per_head_step(*args)
    assert o.shape == (1, Hv, Dv) and S1.shape == (Hv, Dv, Dk)
    assert np.array_equal(np.array(o), np.array(o_ref)) and np.array_equal(np.array(S1), np.array(S_ref))
    # the delta rule in float64: S' = e^g S + beta (v - e^g S k) k^T, o = S' q
    S64 = np.exp(g[0].astype(np.float64))[:, None, None] * S
    delta = beta[0][:, None] * (v[0] - np.einsum("hdk,hk->hd", S64, k[0]))
    S64 = S64 + delta[:, :, None] * k[0][:, None, :]
    np.testing.assert_allclose(np.array(S1), S64, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(o)[0], np.einsum("hdk,hk->hd", S64, q[0]), rtol=1e-4, atol=1e-4)
