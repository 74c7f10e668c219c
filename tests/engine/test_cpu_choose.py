"""The CPU's choice operation (engine/cpu_ext.cpp choose_rows) against the sampler's MLX operations
(engine/device_sampler.py _choose_ops, top_probability) on random logits: the same token bit for
bit, greedy and sampled at several temperatures, with ties, masked tokens and uniforms at the ends
of [0, 1); the top-token probability within float32 rounding (its sum of ~8,000 terms in another
order: 2e-5 relative), of the raw logits where a bias changed the chosen ones; a row's token
whatever the other rows are; top-k, top-p and min-p cuts as the operations cut, ties and ranks
included; and choose_and_top takes it on the CPU but where float32 would round a setting across
an edge the operations test in double."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext, device_sampler
from engine.config import SamplingParams
from engine.sampler import position_uniform

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_ext.module() is None,
                                reason="the engine's CPU operations are built on Linux with a C++ compiler")


def logits_for(rng: np.random.Generator, rows: int, vocab: int, spread: float, ties: bool) -> np.ndarray:
    x = (rng.standard_normal((rows, vocab)) * spread).astype(np.float32)
    if ties:  # several tokens share the largest logit: the first one is the argmax
        x[:, 1 : min(4, vocab)] = x.max(axis=-1, keepdims=True)
    if vocab > 8:  # masked tokens (a grammar's or a bias's -inf)
        x[:, rng.integers(0, vocab, size=vocab // 8)] = -np.inf
    return x


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7, 1.3, 0.05])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 8192), (17, 8192), (5, 3), (3, 151)])
def test_the_same_tokens_as_the_operations(temperature, rows, vocab):
    rng = np.random.default_rng(rows * 1000 + vocab + int(temperature * 100))
    params = SamplingParams(temperature=temperature, seed=3)
    for trial in range(12):
        x = mx.array(logits_for(rng, rows, vocab, float(rng.choice([0.3, 3.0, 30.0])), ties=trial % 3 == 0))
        uniforms = None
        if temperature > 0:
            u = rng.random(rows).astype(np.float32)
            u[: rows // 3] = np.float32(1.0) - np.float32(2.0**-24)  # next to 1: the draw's end
            u[rows // 3 : rows // 2] = 0.0
            uniforms = mx.array(u)
        want = np.array(device_sampler._choose_ops(x, params, uniforms))
        got, top = cpu_ext.choose_rows(x, uniforms, temperature, x)
        assert np.array_equal(np.array(got), want)
        assert top is not None
        np.testing.assert_allclose(np.array(top), np.array(device_sampler.top_probability(x)), rtol=2e-5)


def test_the_top_is_of_the_raw_logits():
    rng = np.random.default_rng(1)
    raw = mx.array(logits_for(rng, 4, 500, 2.0, ties=False))
    biased = raw + mx.array(rng.normal(size=500).astype(np.float32) * 4)
    u = mx.array(rng.random(4).astype(np.float32))
    for temperature in (0.0, 1.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=0)
        uniforms = u if temperature else None
        got, top = cpu_ext.choose_rows(biased, uniforms, temperature, raw)
        assert np.array_equal(np.array(got), np.array(device_sampler._choose_ops(biased, params, uniforms)))
        assert top is not None
        np.testing.assert_allclose(np.array(top), np.array(device_sampler.top_probability(raw)), rtol=2e-5)
    ids, none = cpu_ext.choose_rows(biased, None, 0.0)
    assert none is None and np.array_equal(np.array(ids), np.array(mx.argmax(biased, axis=-1)))


def test_a_row_is_chosen_alone():
    rng = np.random.default_rng(2)
    x = mx.array(logits_for(rng, 9, 2000, 3.0, ties=False))
    u = mx.array(rng.random(9).astype(np.float32))
    many, tops = cpu_ext.choose_rows(x, u, 1.0, x)
    assert tops is not None
    for n in range(9):
        one, top = cpu_ext.choose_rows(x[n : n + 1], u[n : n + 1], 1.0, x[n : n + 1])
        assert top is not None
        assert int(one[0]) == int(many[n]) and float(top[0]) == float(tops[n])


CUTS = [{"top_k": 20}, {"top_p": 0.8}, {"top_k": 20, "top_p": 0.8}, {"min_p": 0.05}, {"top_k": 50, "min_p": 0.1},
        {"top_k": 3, "top_p": 0.5, "min_p": 0.2}, {"top_p": 0.999}, {"top_k": 1}, {"top_k": 9000}]


@pytest.mark.parametrize("cut", CUTS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_same_tokens_as_the_operations_with_cuts(cut, temperature):
    """Top-k, top-p and min-p as the operations cut: ties at the k-th value kept, the top-p total in
    vocabulary order (device_sampler._total on the CPU), ranks compared in float32."""
    rng = np.random.default_rng(len(cut) * 10 + int(temperature * 10))
    params = SamplingParams(temperature=temperature, seed=3, **cut)
    for trial in range(8):
        rows, vocab = int(rng.integers(1, 9)), int(rng.choice([30, 8192]))
        x = logits_for(rng, rows, vocab, float(rng.choice([0.3, 3.0, 30.0])), ties=trial % 2 == 0)
        if trial % 4 == 1:  # many values tied at the top-k / top-p edges
            x = np.round(x)
        u = rng.random(rows).astype(np.float32)
        u[: rows // 3] = np.float32(1.0) - np.float32(2.0**-24)
        X, U = mx.array(x), mx.array(u)
        want = np.array(device_sampler._choose_ops(X, params, U))
        top_k = min(params.top_k, vocab)
        got, _ = cpu_ext.choose_rows(X, U, temperature, None, top_k, params.top_p, params.min_p)
        assert np.array_equal(np.array(got), want), (cut, trial)


@pytest.mark.parametrize("cut", [{}, *CUTS])
def test_choose_and_top_takes_it_on_the_cpu(cut):
    rng = np.random.default_rng(3)
    x = mx.array(logits_for(rng, 3, 8192, 3.0, ties=False))
    params = SamplingParams(temperature=0.9, seed=1, **cut)
    u = device_sampler.node_uniforms(1, [10, 11, 11])
    assert device_sampler._one_operation(x, params, x)
    ids, top = device_sampler.choose_and_top(x, params, u, x)
    assert np.array_equal(np.array(ids), np.array(device_sampler._choose_ops(x, params, u)))
    assert top is not None
    np.testing.assert_allclose(np.array(top), np.array(device_sampler.top_probability(x)), rtol=2e-5)


def test_where_float32_would_round_across_an_edge_the_operations_run():
    x = mx.zeros((1, 10))
    assert not device_sampler._one_operation(x.astype(mx.bfloat16), SamplingParams(), None)
    assert not device_sampler._one_operation(x, SamplingParams(temperature=1e-46), None)  # 0 in float32
    assert not device_sampler._one_operation(x, SamplingParams(temperature=1.0, top_p=1 - 1e-12), None)  # 1
    assert not device_sampler._one_operation(x, SamplingParams(temperature=1.0, min_p=1e-50), None)  # 0
    assert device_sampler._one_operation(x, SamplingParams(temperature=1.0, top_p=0.99999), None)


def test_bad_shapes_are_refused():
    x = mx.zeros((2, 10))
    with pytest.raises(ValueError, match="uniforms"):
        cpu_ext.choose_rows(x, None, 1.0)
    with pytest.raises(ValueError, match="raw"):
        cpu_ext.choose_rows(x, None, 0.0, mx.zeros((2, 11)))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        cpu_ext.choose_rows(mx.zeros((10,)), None, 0.0)


@pytest.mark.parametrize("settings", [{"repetition_penalty": 1.1}, {"repetition_penalty": 0.8},
                                      {"frequency_penalty": 0.5, "presence_penalty": -0.3},
                                      {"logit_bias": ((3, 5.0), (7, -100.0))},
                                      {"frequency_penalty": 1.2, "presence_penalty": 0.4, "repetition_penalty": 1.3,
                                       "logit_bias": ((1, 2.5),)}])
def test_penalties_in_one_operation_are_the_operations(settings, monkeypatch):
    """DevicePenalties' rows through penalize_rows: bit for bit its MLX operations (_adjust), for a
    one-node round and a tree's rows (whose path pairs the operations recompute after it)."""
    from engine.device_penalties import DevicePenalties
    from engine.tree import DraftTree

    rng = np.random.default_rng(len(settings))
    vocab = 300
    params = SamplingParams(temperature=0.8, seed=0, **settings)
    prompt = rng.integers(0, vocab, size=40).tolist()
    generated = rng.integers(0, vocab, size=25).tolist()
    tree = DraftTree((5, 7, 9, 7, 3), (-1, 0, 0, 1, 3))  # token 7 twice on one path
    for rows, shape_tree in ((1, None), (tree.size, tree)):
        x = mx.array((rng.standard_normal((rows, vocab)) * 4).astype(np.float32))
        got = np.array(DevicePenalties(params, vocab, prompt, generated).apply(x, shape_tree))
        monkeypatch.setattr(cpu_ext, "CHOOSE", False)
        want = np.array(DevicePenalties(params, vocab, prompt, generated).apply(x, shape_tree))
        monkeypatch.setattr(cpu_ext, "CHOOSE", True)
        assert np.array_equal(got, want)
        assert not np.array_equal(got, np.array(x))  # something was adjusted


def near_ties(rng: np.random.Generator, x: np.ndarray, k: int) -> np.ndarray:
    """x with values a few float32 steps around each row's k-th largest: distinct logits whose
    2^y may round to the k-th value's (ties after exp that the operations keep)."""
    x = x.copy()
    for row in x:
        kth = np.sort(row[np.isfinite(row)])[::-1][min(k, np.isfinite(row).sum()) - 1]
        at = rng.choice(row.size, size=min(12, row.size), replace=False)
        steps = rng.integers(-6, 3, size=at.size)
        row[at] = [np.float32(kth) if s == 0 else np.nextafter(np.float32(kth), np.float32(np.inf * np.sign(s)),
                                                             dtype=np.float32) if abs(s) == 1 else
                   np.float32(kth) + np.float32(s) * np.spacing(np.float32(kth)) for s in steps]
    return x


@pytest.mark.parametrize("top_k", [1, 2, 20, 50, 4095])
@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 1.3, 7.5])
def test_a_narrowed_top_k_draw_is_the_full_pass(top_k, temperature, monkeypatch):
    """The top-k draw that computes 2^y only where it can reach the k-th largest value (the fast
    path) against choose_rows' full pass (its twin) and the operations: the same token bit for bit,
    near-ties at the k-th value, masked tokens, top-p and min-p after it, uniforms at both ends."""
    rng = np.random.default_rng(top_k * 100 + int(temperature * 10))
    for trial in range(6):
        rows, vocab = 8, int(rng.choice([4096, 8192]))
        x = logits_for(rng, rows, vocab, float(rng.choice([0.3, 3.0, 30.0])), ties=trial % 2 == 0)
        x = near_ties(rng, x, top_k) if trial % 3 != 2 else np.round(x)
        u = rng.random(rows).astype(np.float32)
        u[0], u[1] = np.float32(1.0) - np.float32(2.0**-24), 0.0
        X, U = mx.array(x), mx.array(u)
        for top_p, min_p in ((1.0, 0.0), (0.8, 0.0), (0.95, 0.05)):
            params = SamplingParams(temperature=temperature, seed=0, top_k=top_k, top_p=top_p, min_p=min_p)
            monkeypatch.setattr(cpu_ext, "NARROW_TOP_K", True)
            fast, _ = cpu_ext.choose_rows(X, U, temperature, None, top_k, top_p, min_p)
            monkeypatch.setattr(cpu_ext, "NARROW_TOP_K", False)
            full, _ = cpu_ext.choose_rows(X, U, temperature, None, top_k, top_p, min_p)
            ops = device_sampler._choose_ops(X, params, U)
            assert np.array_equal(np.array(fast), np.array(full)), (trial, top_p, min_p)
            assert np.array_equal(np.array(fast), np.array(ops)), (trial, top_p, min_p)


def test_the_narrow_draw_leaves_the_odd_rows_to_the_full_pass(monkeypatch):
    """Where its reasoning does not hold the narrow draw hands the row to the full pass: a NaN or
    +inf logit, every logit masked, a k-th largest value that 2^y rounds to a subnormal or to 0
    (a wide spread at a low temperature). The same tokens either way."""
    rng = np.random.default_rng(7)
    x = logits_for(rng, 6, 4096, 3.0, ties=False)
    x[0, 17] = np.nan
    x[1, 99] = np.inf
    x[2, :] = -np.inf
    x[3] = (rng.standard_normal(4096) * 2000).astype(np.float32)  # 2^y of the 20th largest: 0
    x[4] = np.linspace(0, -120, 4096, dtype=np.float32)  # around the subnormal edge at t = 1
    X, U = mx.array(x), mx.array(rng.random(6).astype(np.float32))
    for temperature in (1.0, 0.05):
        monkeypatch.setattr(cpu_ext, "NARROW_TOP_K", True)
        fast, _ = cpu_ext.choose_rows(X, U, temperature, None, 20, 0.8, 0.0)
        monkeypatch.setattr(cpu_ext, "NARROW_TOP_K", False)
        full, _ = cpu_ext.choose_rows(X, U, temperature, None, 20, 0.8, 0.0)
        assert np.array_equal(np.array(fast), np.array(full))
        params = SamplingParams(temperature=temperature, seed=0, top_k=20, top_p=0.8)
        ops = np.array(device_sampler._choose_ops(X[2:], params, U[2:]))
        assert np.array_equal(np.array(fast)[2:], ops)


@pytest.mark.parametrize("settings", [{}, {"repetition_penalty": 1.1}, {"repetition_penalty": 0.8},
                                      {"frequency_penalty": 0.4, "presence_penalty": 0.3},
                                      {"logit_bias": ((5, 3.0), (7, -100.0)), "repetition_penalty": 1.2,
                                       "frequency_penalty": -0.2}])
@pytest.mark.parametrize("cut", [{}, {"top_k": 20, "top_p": 0.8}, {"top_p": 0.9}, {"min_p": 0.05}])
def test_a_node_drawn_at_once_is_the_graphs_draw(settings, cut):
    """cpu_ext.draw_now (a visited node of a sampled tree, chosen on the host at once: the fast
    path) against the node's one-row graph (DevicePenalties.apply, then choose: its twin): the same
    token for every node of a tree whose paths repeat tokens, with and without penalties."""
    from engine.device_penalties import DevicePenalties
    from engine.tree import DraftTree

    rng = np.random.default_rng(len(settings) * 10 + len(cut))
    vocab = 2048
    tree = DraftTree((7, 9, 9, 7, 5, 9, 11, 7), (-1, 0, 1, 1, 2, 3, 4, 6))  # 9 and 7 twice on some paths
    params = SamplingParams(temperature=0.8, seed=4, **settings, **cut)
    prompt, generated = [int(t) for t in rng.integers(0, vocab, 40)], [7, 9, 12, 9]
    for trial in range(6):
        logits = mx.array(logits_for(rng, tree.size, vocab, float(rng.choice([0.5, 3.0])), ties=trial % 2 == 0))
        pen = DevicePenalties(params, vocab, prompt, generated) if params.reweights else None
        for node in range(tree.size):
            position = 100 + int(tree.depths[node])
            row = logits[node : node + 1] if pen is None else pen.apply(logits[node : node + 1], tree, None, [node])
            want = int(device_sampler.choose(row, params, device_sampler.node_uniforms(4, [position]))[0])
            cols, extra = pen.path_counts(tree, node) if pen is not None else ([], [])
            got = cpu_ext.draw_now(logits, node, None if pen is None else pen.counts,
                                   None if pen is None else pen.bias, None if pen is None else pen.in_prompt,
                                   cols, extra, params.frequency_penalty, params.presence_penalty,
                                   params.repetition_penalty, params.penalized, params.temperature,
                                   min(params.top_k, vocab), params.top_p, params.min_p,
                                   position_uniform(4, position))
            assert got == want, (trial, node)


def test_a_node_drawn_at_once_refuses_what_it_cannot_draw():
    x = mx.zeros((2, 16))
    with pytest.raises(ValueError):
        cpu_ext.draw_now(x, 2, None, None, None, [], [], 0, 0, 1, False, 1.0, 0, 1.0, 0.0, 0.5)  # no such row
    with pytest.raises(ValueError):
        cpu_ext.draw_now(x, 0, None, None, None, [], [], 0, 0, 1, False, 0.0, 0, 1.0, 0.0, 0.5)  # greedy
    with pytest.raises(ValueError):
        cpu_ext.draw_now(x, 0, mx.zeros((8,)), None, None, [], [], 0, 0, 1, False, 1.0, 0, 1.0, 0.0, 0.5)
    with pytest.raises(ValueError):
        cpu_ext.draw_now(x, 0, mx.zeros((16,)), None, None, [99], [1.0], 0, 0, 1, False, 1.0, 0, 1.0, 0.0, 0.5)


def test_rows_top_at_once_is_the_controllers_confidence():
    """cpu_ext.top_rows_now (a tree's accepted rows, at once on the host) against the host's float64
    top_probabilities: within float32 rounding, masked tokens included; bad rows refused."""
    from engine.logits_extras import top_probabilities

    rng = np.random.default_rng(9)
    x = logits_for(rng, 6, 8192, 3.0, ties=True)
    rows = [0, 3, 5, 3]
    got = np.array(cpu_ext.top_rows_now(mx.array(x), rows))
    np.testing.assert_allclose(got, top_probabilities(x[rows]), rtol=2e-5)
    with pytest.raises(ValueError):
        cpu_ext.top_rows_now(mx.array(x), [6])
