"""engine/gdn/ops.py ConvViews: the conv weight's views held since loading give the chain and tree
convolutions bitwise what the views built in the graph give, and a weight replaced after holding
is read as it is now."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.gdn import ops
from engine.loader import load_model
from engine.models.gated_deltanet import DepthwiseConv

C, K = 48, 4


def arrays(seed: int, rows: int) -> tuple[mx.array, mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    x, state, w = (mx.array(rng.normal(size=s).astype(np.float32)) for s in ((rows, C), (K - 1, C), (C, K)))
    return x, state, w


@pytest.mark.parametrize("rows", [1, 2, 9])
def test_chain_conv_with_held_views_is_bitwise_the_same(rows):
    x, state, w = arrays(rows, rows)
    views = ops.ConvViews.of(w)
    assert views is not None
    plain = ops.causal_conv(x, state, w)
    held = ops.causal_conv(x, state, w, views)
    compiled = mx.compile(lambda x, s: ops.causal_conv(x, s, w, views))(x, state)
    for ours in (held, compiled):
        for a, b in zip(ours, plain, strict=True):
            assert np.array_equal(np.array(a), np.array(b))


def test_tree_conv_with_held_views_is_bitwise_the_same():
    parents = [-1, 0, 0, 1, 1, 2, 5, 6]
    x, state, w = arrays(3, len(parents))
    taps = mx.array(ops.tree_conv_taps(parents, K))
    views = ops.ConvViews.of(w)
    plain = ops.tree_conv(x, state, w, taps)
    assert np.array_equal(np.array(ops.tree_conv(x, state, w, taps, views)), np.array(plain))


def test_views_of_another_weight_or_dtype_are_not_used():
    x, state, w = arrays(5, 3)
    assert ops.ConvViews.of(w.astype(mx.bfloat16)) is None  # the convs cast first: no view of the cast
    stale = ops.ConvViews.of(mx.zeros((C, K)))  # held before the weight was replaced
    assert np.array_equal(np.array(ops.causal_conv(x, state, w, stale)[0]), np.array(ops.causal_conv(x, state, w)[0]))
    conv = DepthwiseConv(C, K)
    conv.hold_views()
    assert conv.views is not None
    conv.weight = w  # e.g. load_weights after holding
    assert conv.views is None


def test_the_loader_holds_every_conv_and_logits_do_not_move(tiny_qwen35):
    """A loaded model's convs all hold their views; a second copy without them gives a decode
    step's and a tree verify's logits bitwise the same."""
    from engine import forward
    from engine.tree import DraftTree

    logits = []
    for held in (True, False):
        model = load_model(tiny_qwen35, "float32").model
        convs = [m for m in model.modules() if isinstance(m, DepthwiseConv)]
        assert convs and all(m.views is not None for m in convs)
        if not held:
            for m in convs:
                del m._views
        cache = model.make_cache()
        forward.extend(model, cache, [1, 2, 3, 4, 5, 6])
        step = np.array(forward.verify(model, cache, DraftTree.single(3), 6))
        tree = np.array(forward.verify(model, cache, DraftTree((3, 5, 9, 11), (-1, 0, 0, 1)), 6))
        logits.append((step, tree))
    for a, b in zip(*logits, strict=True):
        assert np.array_equal(a, b)
