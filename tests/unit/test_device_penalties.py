"""Bias and penalties on the device against the host's adjust_logits (their float64 twin): every
node of random trees, with the completion's counts and the node's own path tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.config import SamplingParams
from engine.device_penalties import DevicePenalties
from engine.logits_extras import adjust_logits
from engine.tree import DraftTree

PARAMS = [
    SamplingParams(repetition_penalty=1.1),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(frequency_penalty=-0.4, repetition_penalty=1.3, logit_bias=((3, 5.0), (17, -100.0))),
    SamplingParams(logit_bias=((0, 2.5),)),
]


def random_tree(rng: np.random.Generator, size: int, vocab: int) -> DraftTree:
    """Parents before children; tokens drawn from a small range so paths repeat tokens (siblings'
    differ, as in every draft tree)."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    tokens = [int(rng.integers(0, 24))]
    for i in range(1, size):
        taken = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(int(rng.choice([t for t in range(min(vocab, 24)) if t not in taken])))
    return DraftTree(tuple(tokens), tuple(parents))


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("size", [1, 2, 9, 17])
def test_device_adjustment_equals_the_host_one(params, size, rng):
    vocab = 512
    logits = (rng.normal(size=(size, vocab)) * 4).astype(np.float32)
    prompt = [int(t) for t in rng.integers(0, 40, 30)]
    generated = [int(t) for t in rng.integers(0, 40, 25)]  # repeats: counts above one
    tree = random_tree(rng, size, vocab)
    pen = DevicePenalties(params, vocab, prompt, generated[:10])
    pen.add(generated[10:20])
    pen.add(mx.array(generated[20:], dtype=mx.int32))  # tokens still on the device
    device = np.array(pen.apply(mx.array(logits), tree))
    for node in range(size):
        path = [tree.tokens[j] for j in tree.path_to(node)[1:]]
        host = adjust_logits(logits[node], [*generated, *path], params, frozenset(prompt))
        np.testing.assert_allclose(device[node], host, rtol=2e-6, atol=2e-6)
        # one row at a time (the CPU's node-by-node draw) is the same computation
        row = np.array(pen.apply(mx.array(logits[node : node + 1]), tree, rows=[node]))[0]
        assert np.array_equal(row, device[node])
    # the tree's tokens on the device only (the host tree holds placeholders): the same adjustment
    placeholders = DraftTree(tuple(range(size)), tree.parents)
    on_device = np.array(pen.apply(mx.array(logits), placeholders, mx.array([list(tree.tokens)], dtype=mx.int32)))
    np.testing.assert_array_equal(on_device, device)


def test_one_guess_tree_with_its_tokens_on_the_device(rng):
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)
    vocab = 64
    logits = (rng.normal(size=(2, vocab)) * 3).astype(np.float32)
    pen = DevicePenalties(params, vocab, [1, 2, 3], [5, 5, 9])
    placeholder = DraftTree.chain(0, [0])
    tokens = mx.array([[9, 7]], dtype=mx.int32)  # the root and the guess, never on the host
    device = np.array(pen.apply(mx.array(logits), placeholder, tokens))
    known = np.array(pen.apply(mx.array(logits), DraftTree.chain(9, [7])))
    assert np.array_equal(device, known)
    host = adjust_logits(logits[1], [5, 5, 9, 7], params, frozenset([1, 2, 3]))
    np.testing.assert_allclose(device[1], host, rtol=2e-6, atol=2e-6)


def test_without_adjustments_nothing_is_applied():
    assert not SamplingParams(temperature=0.7, top_p=0.9, seed=1).reweights
    assert all(p.reweights for p in PARAMS)
