"""engine/models/linear.py: the held transposed view multiplies bitwise as nn.Linear's weight.T does,
and a weight replaced after it was held is multiplied as it is now, not as it was."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.loader import load_model
from engine.models.linear import Linear, hold_views


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_held_transpose_is_bitwise_nn_linear(bias, rows):
    rng = np.random.default_rng(rows)
    ours, theirs = Linear(96, 160, bias=bias), nn.Linear(96, 160, bias=bias)
    theirs.update(ours.parameters())
    assert hold_views(ours) == 1
    x = mx.array(rng.normal(size=(1, rows, 96)).astype(np.float32))
    assert np.array_equal(np.array(ours(x)), np.array(theirs(x)))
    compiled = mx.compile(lambda x: ours(x))  # the held view is a constant of the trace, not a node
    assert np.array_equal(np.array(compiled(x)), np.array(theirs(x)))


def test_a_weight_replaced_after_holding_is_used_as_it_is():
    rng = np.random.default_rng(0)
    layer = Linear(32, 8, bias=False)
    hold_views(layer)
    x = mx.array(rng.normal(size=(1, 2, 32)).astype(np.float32))
    layer.weight = mx.array(rng.normal(size=(8, 32)).astype(np.float32))  # e.g. load_weights after loading
    np.testing.assert_allclose(np.array(layer(x)), np.array(x) @ np.array(layer.weight).T, rtol=1e-5, atol=1e-5)
    layer.update({"weight": mx.zeros((8, 32))})
    assert not np.array(layer(x)).any()


def test_the_loader_holds_every_linear_and_logits_do_not_move(tiny_qwen35):
    """A loaded model's Linears all hold their transposes; a second copy whose Linears hold none
    (each multiplies through weight.T, traced so) gives a verify's logits bitwise the same."""
    from engine import forward
    from engine.tree import DraftTree

    logits = []
    for held in (True, False):
        model = load_model(tiny_qwen35, "float32").model
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert layers and all(getattr(m, "_held", None) is not None for m in layers)
        if not held:
            for m in layers:
                del m._held
        cache = model.make_cache()
        forward.extend(model, cache, [1, 2, 3, 4, 5, 6])
        logits.append(np.array(forward.verify(model, cache, DraftTree.chain(3, [5, 9, 11]), 6)))
    assert np.array_equal(*logits)


@pytest.mark.parametrize("rows", [1, 5])
def test_the_mlp_on_flattened_rows_is_bitwise_the_batched_products(rows):
    """MLP multiplies [T, H] rows (fewer graph nodes on the CPU); the products of the [1, T, H]
    input give the same bits."""
    from engine.cpu_exp import silu
    from engine.models.layers import MLP

    rng = np.random.default_rng(rows)
    mlp = MLP(64, 96)
    mlp.update({name: {"weight": mx.array(rng.normal(size=p["weight"].shape).astype(np.float32))}
                for name, p in mlp.children().items()})
    hold_views(mlp)
    x = mx.array(rng.normal(size=(1, rows, 64)).astype(np.float32))
    batched = (x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T)
    expected = (silu(batched[0]) * batched[1]) @ mlp.down_proj.weight.T
    out = mlp(x)
    assert out.shape == (1, rows, 64)
    assert np.array_equal(np.array(out), np.array(expected))
