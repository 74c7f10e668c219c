"""Logits processing, position-keyed uniforms, inverse-CDF draws and the accept walk."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SamplingParams
from engine.sampler import (
    Acceptance,
    _splitmix64,
    accept,
    inverse_cdf,
    position_uniform,
    process_logits,
    sample_token,
)
from engine.tree import DraftTree
from tests.unit.strategies import draft_trees


def reference_probs(x: np.ndarray, prm: SamplingParams) -> np.ndarray:
    """Straightforward full-sort version of process_logits (temperature, top_k, top_p, min_p)."""
    # the temperature as the engine applies it (shift, then divide): dividing first rounds p
    # differently, and a top_p within rounding of 1 then keeps one tail token more or less
    x = np.asarray(x, dtype=np.float64)
    p = np.exp((x - x.max()) / prm.temperature)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    if prm.top_k:
        p[order[prm.top_k:]] = 0.0
    if prm.top_p < 1.0:
        target, cum, keep = prm.top_p * p.sum(), 0.0, []
        for i in order:
            keep.append(i)
            cum += p[i]
            if cum >= target:
                break
        mask = np.zeros(len(p), dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
    if prm.min_p:
        p = np.where(p >= prm.min_p * p.max(), p, 0.0)
    return p / p.sum()


sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
)


@st.composite
def logit_rows(draw, max_vocab: int = 600) -> np.ndarray:
    """Random rows, often with exact ties (coarse quantisation) and banned (-inf) tokens."""
    v = draw(st.integers(1, max_vocab))
    seed = draw(st.integers(0, 2**32 - 1))
    r = np.random.default_rng(seed)
    x = r.normal(size=v) * draw(st.floats(0.1, 8.0))
    if draw(st.booleans()):
        x = np.round(x)  # many ties
    banned = r.random(v) < draw(st.floats(0.0, 0.5))
    banned[r.integers(v)] = False
    return np.where(banned, -np.inf, x).astype(np.float32)


@settings(max_examples=300, deadline=None)
@given(logit_rows(), sampling_params)
def test_process_logits_matches_full_sort_reference(x, prm) -> None:
    p = process_logits(x, prm)
    assert p.dtype == np.float64 and p.shape == x.shape
    assert np.all(p >= 0) and abs(p.sum() - 1.0) < 1e-12
    assert np.all(p[np.isneginf(x)] == 0)
    ref = reference_probs(x, prm)
    assert np.array_equal(p > 0, ref > 0)
    np.testing.assert_allclose(p, ref, rtol=1e-12, atol=1e-300)


@settings(max_examples=200, deadline=None)
@given(logit_rows(), sampling_params)
def test_process_logits_filter_properties(x, prm) -> None:
    p = process_logits(x, prm)
    kept = p > 0
    if prm.top_k:
        assert kept.sum() <= prm.top_k
    # kept tokens outrank dropped ones (higher logit, or equal logit and lower id)
    finite = ~np.isneginf(x)
    dropped = np.flatnonzero(finite & ~kept)
    for i in np.flatnonzero(kept):
        assert np.all((x[dropped] < x[i]) | ((x[dropped] == x[i]) & (dropped > i)))
    if prm.min_p:
        assert p[kept].min() >= prm.min_p * p.max() * (1 - 1e-12)


@pytest.mark.parametrize("levels", [3, 40, None])
def test_top_p_on_a_large_vocabulary_matches_full_sort(levels, rng) -> None:
    # nuclei larger than the first candidate pools, and big tie groups straddling the pool cuts
    x = rng.normal(size=20000) * 1.5
    if levels:
        x = np.floor(x * levels / 6)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        for t in (0.5, 1.0, 4.0):
            prm = SamplingParams(temperature=t, top_p=top_p)
            np.testing.assert_allclose(process_logits(x, prm), reference_probs(x, prm), rtol=1e-12, atol=1e-300)


def test_process_logits_top_p_is_the_smallest_nucleus() -> None:
    x = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    for top_p, support in [(0.4, {1}), (0.41, {1, 3}), (0.7, {1, 3}), (0.71, {1, 2, 3}), (1.0, {0, 1, 2, 3})]:
        p = process_logits(x, SamplingParams(temperature=1.0, top_p=top_p))
        assert set(np.flatnonzero(p).tolist()) == support, top_p


def test_ties_resolve_by_token_id() -> None:
    x = np.zeros(6, dtype=np.float32)
    assert np.flatnonzero(process_logits(x, SamplingParams(temperature=1.0, top_k=2))).tolist() == [0, 1]
    assert np.flatnonzero(process_logits(x, SamplingParams(temperature=1.0, top_p=0.5))).tolist() == [0, 1, 2]
    assert sample_token(np.array([1.0, 3.0, 3.0]), SamplingParams(), None, 0) == 1


def test_temperature_scales_softmax_and_greedy_is_one_hot() -> None:
    x = np.array([1.0, 2.0, -1.0, 0.5])
    for t in (0.3, 1.0, 2.5):
        e = np.exp(x / t)
        np.testing.assert_allclose(process_logits(x, SamplingParams(temperature=t)), e / e.sum(), rtol=1e-13)
    assert process_logits(x, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [[], [[1.0]], [np.nan, 1.0], [np.inf, 0.0], [-np.inf, -np.inf]])
def test_bad_logits_raise(bad) -> None:
    with pytest.raises(ValueError):
        process_logits(np.array(bad, dtype=np.float64), SamplingParams(temperature=1.0))


@pytest.mark.parametrize("temperature", [1e-308, 2.2250738585072014e-308, 1e-320, 5e-324])
def test_tiny_temperatures_pick_the_best_token(temperature) -> None:
    """logits / 1e-308 overflows to inf (and inf - inf is NaN): a tiny temperature must act as
    greedy among the best, not fail. Ties at the top keep sharing the mass."""
    x = np.array([1.0, 30.0, -4.0, 30.0, -np.inf, 29.999999])
    p = process_logits(x, SamplingParams(temperature=temperature))
    assert np.isfinite(p).all() and p[1] == p[3] == 0.5
    assert sample_token(x, SamplingParams(temperature=temperature), seed=3, position=7) in (1, 3, 5)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_sampling_params_refuse_a_non_finite_temperature(value) -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=value)


def test_logit_bias_may_name_a_token_once() -> None:
    with pytest.raises(ValueError, match="more than once"):
        SamplingParams(logit_bias=((5, 100.0), (5, 100.0)))


def test_splitmix64_published_stream() -> None:
    # reference outputs of splitmix64 seeded with 1234567 (Vigna's splitmix64.c)
    state, out = 1234567, []
    for _ in range(3):
        state = (state + 0x9E3779B97F4A7C15) % 2**64
        out.append(_splitmix64(state))
    assert out == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def test_position_uniform_is_pinned() -> None:
    # Pinned: changing the hash changes every seeded completion users may have recorded.
    assert position_uniform(0, 0) == pytest.approx(0.6524484863740322, abs=0)
    assert position_uniform(0, 3) == pytest.approx(0.656413707073071, abs=0)


def test_position_uniform_range_determinism_and_spread() -> None:
    us = np.array([position_uniform(11, p) for p in range(20000)])
    assert us.min() >= 0.0 and us.max() < 1.0
    assert [position_uniform(11, p) for p in range(5)] == us[:5].tolist()
    counts = np.histogram(us, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 2000) < 5 * np.sqrt(2000 * 0.9))
    other = np.array([position_uniform(12, p) for p in range(20000)])
    assert abs(np.corrcoef(us, other)[0, 1]) < 0.05
    assert position_uniform(-5, 0) == position_uniform(2**64 - 5, 0)  # seeds live mod 2^64
    with pytest.raises(ValueError):
        position_uniform(1, -1)
    with pytest.raises(ValueError):
        position_uniform(1.5, 2)


def test_inverse_cdf_cells_boundaries_and_gap() -> None:
    probs = np.array([0.0, 0.25, 0.0, 0.5, 0.25, 0.0])
    assert inverse_cdf(probs, 0.0) == 1  # a zero-probability token is never drawn, even at u = 0
    assert inverse_cdf(probs, 0.25) == 3  # u on a cell boundary belongs to the next cell
    assert inverse_cdf(probs, 0.7499999) == 3 and inverse_cdf(probs, 0.75) == 4
    assert inverse_cdf(probs, np.nextafter(1.0, 0.0)) == 4
    short = np.array([0.3, 0.7 - 3e-16, 0.0])  # sums just below 1: no gap at the top
    assert inverse_cdf(short, np.nextafter(1.0, 0.0)) == 1
    with pytest.raises(ValueError):
        inverse_cdf(probs, 1.0)


def test_sample_token_frequencies_follow_probs(rng) -> None:
    x = rng.normal(size=5)
    prm = SamplingParams(temperature=0.8, top_k=4)
    p = process_logits(x, prm)
    seed = int(rng.integers(2**31))
    draws = np.array([sample_token(x, prm, seed, pos) for pos in range(20000)])
    counts = np.bincount(draws, minlength=5)
    assert counts[p == 0].sum() == 0
    assert np.all(np.abs(counts - 20000 * p) < 5 * np.sqrt(20000 * p * (1 - p)) + 1)
    assert [sample_token(x, prm, seed, pos) for pos in range(50)] == draws[:50].tolist()


def test_sampling_without_seed_raises() -> None:
    with pytest.raises(ValueError, match="seed"):
        sample_token(np.zeros(3), SamplingParams(temperature=1.0), None, 0)
    with pytest.raises(ValueError, match="seed"):
        accept(DraftTree.single(0), np.zeros((1, 3)), SamplingParams(temperature=1.0), None, 0)


def _one_hot_rows(n: int, v: int, winners: list[int]) -> np.ndarray:
    logits = np.zeros((n, v), dtype=np.float32)
    logits[np.arange(n), winners] = 5.0
    return logits


def test_greedy_walk() -> None:
    # root(9) -> 1 -> 3, root -> 2 -> 4 ; target argmax after each node below
    tree = DraftTree((9, 1, 2, 3, 4), (-1, 0, 0, 1, 2))
    greedy = SamplingParams()
    assert accept(tree, _one_hot_rows(5, 6, [2, 0, 4, 0, 5]), greedy, None, 10) == Acceptance((0, 2, 4), (2, 4, 5))
    assert accept(tree, _one_hot_rows(5, 6, [5, 0, 0, 0, 0]), greedy, None, 10) == Acceptance((0,), (5,))
    assert accept(tree, _one_hot_rows(5, 6, [1, 3, 0, 0, 0]), greedy, None, 0) == Acceptance((0, 1, 3), (1, 3, 0))
    stop = SamplingParams(stop_token_ids=(4,))
    assert accept(tree, _one_hot_rows(5, 6, [2, 0, 4, 0, 5]), stop, None, 10) == Acceptance((0, 2), (2, 4))


def test_accept_shape_errors() -> None:
    tree = DraftTree.chain(0, [1])
    with pytest.raises(ValueError, match="logits must be"):
        accept(tree, np.zeros((3, 4)), SamplingParams(), None, 0)
    with pytest.raises(ValueError, match="logits must be"):
        accept(tree, np.zeros(4), SamplingParams(), None, 0)
    with pytest.raises(ValueError, match="committed_len"):
        accept(tree, np.zeros((2, 4)), SamplingParams(), None, -1)


@settings(max_examples=100, deadline=None)
@given(draft_trees(max_nodes=16, vocab=6), st.integers(0, 2**32 - 1), st.booleans(), st.integers(0, 100))
def test_acceptance_invariants(tree, seed, greedy, committed_len) -> None:
    r = np.random.default_rng(seed)
    logits = r.normal(size=(tree.size, 6)) * 2
    prm = SamplingParams() if greedy else SamplingParams(temperature=1.0, stop_token_ids=(5,))
    acc = accept(tree, logits, prm, seed, committed_len)
    assert len(acc.path) == len(acc.tokens) == acc.accepted_drafts + 1
    assert acc.path == tuple(tree.path_to(acc.path[-1]))
    assert acc.tokens[:-1] == tuple(tree.tokens[i] for i in acc.path[1:])
    assert acc.bonus == 5 or tree.child_with_token(acc.path[-1], acc.bonus) is None
    assert 5 not in acc.tokens[:-1] or greedy
    depth = len(acc.path) - 1
    expect = sample_token(logits[acc.path[-1]], prm, seed, committed_len + depth + 1)
    assert acc.bonus == expect
    cut = acc.truncated(1)
    assert cut.path == (0,) and cut.tokens == acc.tokens[:1]
