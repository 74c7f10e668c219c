"""Softmax, log-sum-exp, sigmoid and SiLU through a power of two (engine/cpu_exp.py) against MLX's
own, both ways of the switches, on random inputs with masked (-inf) entries and saturating ones."""

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


def gate_inputs(seed: int) -> mx.array:
    """Typical pre-activations, plus the extremes where 2^(-x log2 e) overflows or vanishes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=4000).astype(np.float32) * 4
    extremes = np.array([0.0, -0.0, 1e-30, -1e-30, 30, -30, 88, -88, 89, -89, 100, -100, 1e4, -1e4, 3e38, -3e38],
                        dtype=np.float32)
    return mx.array(np.concatenate([x, extremes]))


@pytest.mark.parametrize("pow_gates", [True, False])
def test_sigmoid_and_silu_equal_mlx_within_rounding(pow_gates, monkeypatch):
    monkeypatch.setattr(cpu_exp, "POW_GATES", pow_gates)
    x = gate_inputs(9)
    with mx.stream(mx.cpu):
        got_sig, got_silu = np.array(cpu_exp.sigmoid(x)), np.array(cpu_exp.silu(x))
        ref_sig, ref_silu = np.array(mx.sigmoid(x)), np.array(x * mx.sigmoid(x))
    assert np.isfinite(got_sig).all() and np.isfinite(got_silu).all()
    assert np.abs(got_sig - ref_sig).max() <= 4e-7  # a few float32 ulps of values in [0, 1]
    rel = np.abs(got_silu - ref_silu) / np.maximum(np.abs(ref_silu), 1e-30)
    assert rel.max() <= 1e-6
    xs = np.array(x)
    assert np.all(got_sig[xs >= 89] == 1.0) and np.all(got_sig[xs <= -89] == 0.0)  # saturated, as MLX's
    assert np.all(got_silu[xs <= -89] == 0.0) and np.all(got_silu[xs >= 89] == xs[xs >= 89])


def test_gates_leave_half_precision_to_mlx():
    """In bf16 x log2 e would round before the power: those arrays take MLX's functions, bit for bit."""
    x = gate_inputs(10).astype(mx.bfloat16)
    assert mx.array_equal(cpu_exp.sigmoid(x), mx.sigmoid(x))
    assert mx.array_equal(cpu_exp.silu(x), x * mx.sigmoid(x))


def test_compiled_shifted_power_is_the_plain_spelling_bit_for_bit():
    """softmax_rows' compiled pass computes what the three separate operations computed."""
    x, _ = masked_scores(11)
    with mx.stream(mx.cpu):
        m = mx.max(x, axis=-1, keepdims=True)
        plain = mx.power(2.0, (x - m) * cpu_exp.LOG2E)
        assert mx.array_equal(cpu_exp._exp2_shifted(x, m), plain)


@pytest.mark.parametrize("pow_exp", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_exp_shifted_is_exp_of_the_expression_bit_for_bit(pow_exp, temperature, monkeypatch):
    """The sampler's one compiled pass: the bits of exp((x - m) / t) spelled out, both switches."""
    monkeypatch.setattr(cpu_exp, "POW_EXP", pow_exp)
    x, _ = masked_scores(12)
    m = mx.max(x, axis=-1, keepdims=True)
    spelled = cpu_exp.exp((x - m) / temperature)
    got = cpu_exp.exp_shifted(x, m, temperature)
    assert np.array_equal(np.array(got).view(np.uint32), np.array(spelled).view(np.uint32))
