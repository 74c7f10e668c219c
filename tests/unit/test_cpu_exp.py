"""Softmax and log-sum-exp through a power of two (engine/cpu_exp.py) against MLX's own, both
ways of the switch, on random inputs with masked (-inf) entries."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_exp
from engine.drafters.marginals import top_k_logp


def masked_scores(seed: int) -> tuple[mx.array, np.ndarray]:
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(2, 7, 300)).astype(np.float32) * 6
    seen = rng.random(size=scores.shape) < 0.7
    seen[:, 0, :] = False
    seen[:, :, 0] = True  # every row sees at least one entry; row 0 that one only
    return mx.where(mx.array(seen), mx.array(scores), -mx.inf), seen


@pytest.mark.parametrize("pow_exp", [True, False])
def test_softmax_rows_equals_mx_softmax(pow_exp, monkeypatch):
    monkeypatch.setattr(cpu_exp, "POW_EXP", pow_exp)
    x, seen = masked_scores(5)
    ours, ref = np.array(cpu_exp.softmax_rows(x)), np.array(mx.softmax(x, axis=-1))
    assert np.abs(ours - ref).max() <= 1e-6
    assert np.all(ours[~seen] == 0.0) and np.allclose(ours.sum(axis=-1), 1.0, atol=1e-6)
    assert np.all(ours[:, 0, 0] == 1.0)


@pytest.mark.parametrize("pow_exp", [True, False])
def test_logsumexp_rows_equals_mx_logsumexp(pow_exp, monkeypatch):
    monkeypatch.setattr(cpu_exp, "POW_EXP", pow_exp)
    x, _ = masked_scores(6)
    big = mx.array(np.random.default_rng(7).normal(size=(3, 8192)).astype(np.float32) * 40)  # no overflow
    for arr in (x, big):
        ours, ref = np.array(cpu_exp.logsumexp_rows(arr)), np.array(mx.logsumexp(arr, axis=-1, keepdims=True))
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= 1e-5 * max(1.0, float(np.abs(ref).max()))


def test_top_k_logp_normalises_like_a_full_log_softmax():
    logits = mx.array(np.random.default_rng(8).normal(size=(15, 4096)).astype(np.float32) * 3)
    ids, top = top_k_logp(logits, 32)
    full = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    want = np.sort(full, axis=-1)[:, ::-1][:, :32]
    assert np.abs(np.array(top) - want).max() <= 1e-5  # the k largest, most likely first
    assert np.abs(np.take_along_axis(full, np.array(ids), axis=-1) - np.array(top)).max() <= 1e-5  # of these ids
