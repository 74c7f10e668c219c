"""A one-token pass in compiled segments (engine/models/segments.py, the fast path) against the
same pass layer by layer (its twin): the same logits, caches and recorded features, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import forward
from engine.feature_cache import FeatureCache, FeatureTaps
from engine.loader import load_model
from engine.models import segments
from engine.models.segments import Segment, plan
from engine.tree import DraftTree

PROMPT = [3, 17, 5, 99, 42, 8, 61, 23, 7, 14, 250, 31, 2, 77, 19, 40]


def test_plan_cuts_at_each_attention_layer():
    G, A = False, True
    assert plan([G, G, G, A, G, G, G, A]) == (
        Segment(None, (0, 1, 2), 3), Segment(3, (4, 5, 6), 7), Segment(7, (), None))
    assert plan([A, A]) == (Segment(None, (), 0), Segment(0, (), 1), Segment(1, (), None))
    assert plan([G, G]) == (Segment(None, (0, 1), None),)
    assert plan([A, G, A, G]) == (Segment(None, (), 0), Segment(0, (1,), 2), Segment(2, (3,), None))


def decode(path, on: bool, steps: int, taps: FeatureTaps | None = None) -> tuple[list[np.ndarray], list[np.ndarray],
                                                                                 np.ndarray | None]:
    """Greedy one-node rounds after the prompt -> (each step's logits, the caches' arrays at the
    end, the features recorded)."""
    saved = segments.SEGMENTS
    segments.SEGMENTS = on
    try:
        model = load_model(path, "float32").model
        features = FeatureCache(taps) if taps is not None else None
        cache = [*model.make_cache(), *([features] if features is not None else [])]
        forward.extend(model, cache, PROMPT)
        token, length, logits = PROMPT[-1], len(PROMPT), []
        for _ in range(steps):
            out = forward.verify(model, cache, DraftTree.single(token), length)
            forward.commit(cache, [0])
            logits.append(np.array(out))
            token, length = int(np.argmax(logits[-1][0])), length + 1
        states = [np.array(a) for a in forward.state_arrays(cache[: len(model.model.layers)])]
        recorded = np.array(features.read(0)) if features is not None else None
        return logits, states, recorded
    finally:
        segments.SEGMENTS = saved


@pytest.mark.parametrize("fixture", ["tiny_qwen35", "tiny_qwen3"])
def test_segments_equal_the_layers_bitwise(fixture, request, monkeypatch):
    """Logits of every step and the caches after them, hybrid and attention-only models; the
    segments ran (their compiled calls), the layer-by-layer path did not take them."""
    path = request.getfixturevalue(fixture)
    runs: list[int] = []
    real = segments.Segments.run
    monkeypatch.setattr(segments.Segments, "run", lambda self, *a: runs.append(1) or real(self, *a))
    fast = decode(path, True, 12)
    assert len(runs) == 12
    plain = decode(path, False, 12)
    assert len(runs) == 12
    for a, b in zip(fast[0] + fast[1], plain[0] + plain[1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_segments_record_the_layers_features(tiny_qwen35):
    """A drafter's taps (DFlash: layers; MTP: the final state) read inside the segments are the
    layer-by-layer ones, bit for bit."""
    taps = FeatureTaps(final=True, layers=(0, 1, 3))
    fast = decode(tiny_qwen35, True, 6, taps)
    plain = decode(tiny_qwen35, False, 6, taps)
    assert fast[2] is not None and plain[2] is not None
    np.testing.assert_array_equal(fast[2], plain[2])
    np.testing.assert_array_equal(fast[0][-1], plain[0][-1])


def test_segments_with_the_residual_pending(tiny_qwen35, monkeypatch):
    """With each MLP output left pending into the next layer's norm (the fused add + norm forced on
    the CPU through its twin), the segments carry it across their ends as the layers do."""
    import engine.fused_norms as fused_norms
    from engine import cpu_ext

    calls: list[int] = []

    def twin(x, y, w, eps):
        calls.append(1)
        h = x + y
        return h, cpu_ext.rms_norm(h, w, eps)

    monkeypatch.setattr(fused_norms, "traces", lambda: (True, False))
    monkeypatch.setattr(fused_norms, "add_norm", twin)
    fast = decode(tiny_qwen35, True, 6, FeatureTaps(final=True, layers=(1, 2)))
    assert calls
    plain = decode(tiny_qwen35, False, 6, FeatureTaps(final=True, layers=(1, 2)))
    for a, b in zip(fast[0] + fast[1] + [fast[2]], plain[0] + plain[1] + [plain[2]], strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_chain_step_writes_through_the_segments(tiny_qwen35):
    """A one-token chain (a drafter's step, prefill of one token): the caches are written at once
    and advance, as layer by layer."""
    out = {}
    for on in (True, False):
        saved = segments.SEGMENTS
        segments.SEGMENTS = on
        try:
            model = load_model(tiny_qwen35, "float32").model
            cache = model.make_cache()
            for t in PROMPT[:5]:
                logits = model(mx.array([[t]]), cache)
            out[on] = [np.array(logits)] + [np.array(a) for a in forward.state_arrays(cache)]
        finally:
            segments.SEGMENTS = saved
    for a, b in zip(out[True], out[False], strict=True):
        np.testing.assert_array_equal(a, b)
