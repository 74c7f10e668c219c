"""After every speculation round the committed state equals a sequential replay of the emitted
tokens: attention K/V, GDN recurrent state and conv state (fp32 on every backend, tight tolerance)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import forward
from engine.cache import GDNCache
from engine.config import SamplingParams
from engine.loader import load_model
from engine.sampler import accept
from engine.tree import DraftTree


def random_tree(rng, root: int, n: int, vocab: int, truth: list[int]) -> DraftTree:
    """Random branches plus one chain along `truth` (what the target will emit) of random depth,
    so that accepted paths of every length and position in node order occur."""
    tokens, parents = [root], [-1]
    depth = int(rng.integers(0, len(truth) + 1))
    for _ in range(n):
        if depth and rng.random() < 0.3:
            chain_parent = 0
            for t in truth[:depth]:
                kids = [i for i in range(len(tokens)) if parents[i] == chain_parent and tokens[i] == t]
                if not kids:
                    tokens.append(t)
                    parents.append(chain_parent)
                    kids = [len(tokens) - 1]
                chain_parent = kids[0]
            depth = 0
            continue
        p = int(rng.integers(0, len(tokens)))
        tok = int(rng.integers(0, vocab))
        if any(parents[i] == p and tokens[i] == tok for i in range(len(tokens))):
            continue
        tokens.append(tok)
        parents.append(p)
    return DraftTree(tuple(tokens), tuple(parents))


def assert_same_state(a, b, upto: int) -> None:
    """Every layer's state after `upto` tokens, through the cache protocol (snapshots raise when a
    cache holds another length)."""
    for ca, cb in zip(a, b, strict=True):
        for x, y in zip(ca.snapshot(upto).arrays(), cb.snapshot(upto).arrays(), strict=True):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


@pytest.mark.parametrize(("compiled", "eval_every", "folded"),
                         [(True, 0, False), (False, 0, False), (True, 1, False), (True, 0, True)],
                         ids=["compiled-commit", "plain-commit", "verify-handed-over-every-layer",
                              "commit-folded-into-the-next-verify"])
def test_commit_equals_replay(tiny_qwen35, compiled, eval_every, folded, monkeypatch):
    """Both commits (the compiled one the engine runs and its plain twin) equal the replay; so does
    a verify handed to the device layer by layer while it is built (the GPU's way, forced here),
    and a commit folded into the next verify (the GPU's way too): there the state is compared
    every third round only, since a comparison runs the commit itself (a snapshot settles it)."""
    monkeypatch.setattr(GDNCache, "compile_commit", compiled)
    monkeypatch.setattr(GDNCache, "fold_commits", folded)
    monkeypatch.setattr(forward, "verify_eval_every", lambda model: eval_every)
    model = load_model(tiny_qwen35, "float32").model
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(0, 500, size=12)]
    cache = model.make_cache()
    model.hidden(mx.array([prompt[:-1]]), cache)
    params = SamplingParams(temperature=1.0, seed=3)
    truth = plain_run(model, prompt, params, 60)
    seq, committed, root = list(prompt), len(prompt) - 1, prompt[-1]
    accepted, folds = 0, 0
    for i in range(12):
        done = len(seq) - len(prompt)
        tree = random_tree(rng, root, int(rng.integers(0, 12)), 512, truth[done : done + 6])
        unfolded = sum(isinstance(c, GDNCache) and c.unfolded is not None for c in cache)
        logits = np.array(forward.verify(model, cache, tree, committed))
        if tree.size > 1:
            folds += unfolded
        acc = accept(tree, logits, params, 3, committed)
        forward.commit(cache, list(acc.path))
        committed += len(acc.path)
        seq += list(acc.tokens)
        root = acc.tokens[-1]
        accepted += len(acc.path) - 1
        if folded and i % 3 != 2:
            continue
        replay = model.make_cache()
        model.hidden(mx.array([seq[:committed]]), replay)
        assert_same_state(cache, replay, committed)
    assert seq[len(prompt):] == truth[: len(seq) - len(prompt)]
    assert (folds > 0) == folded
    assert accepted >= 10  # the rounds really committed multi-token paths


def plain_run(model, prompt, params, n) -> list[int]:
    cache = model.make_cache()
    model.hidden(mx.array([prompt[:-1]]), cache)
    out, committed, root = [], len(prompt) - 1, prompt[-1]
    while len(out) < n:
        tree = DraftTree.single(root)
        acc = accept(tree, np.array(forward.verify(model, cache, tree, committed)), params, 3, committed)
        forward.commit(cache, list(acc.path))
        committed += 1
        out += acc.tokens
        root = acc.tokens[-1]
    return out


def test_snapshots_and_marks_survive_later_writes(tiny_qwen35):
    """Snapshots (prefix cache) and marks (draft drafter) keep the state they were taken at while
    the live cache goes on: tree verifies, commits, chain extends. An implementation that wrote
    state in place would break this."""
    from engine.cache import snapshot_all

    model = load_model(tiny_qwen35, "float32").model
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, 500, size=10)]
    cache = model.make_cache()
    forward.extend(model, cache, prompt)
    snaps = snapshot_all(cache, len(prompt))
    marks = [c.mark() for c in cache]
    before = [np.array(a) for s in snaps for a in s.arrays()]
    committed = len(prompt)
    for _ in range(4):
        tree = random_tree(rng, int(rng.integers(0, 500)), 6, 512, [])
        forward.verify(model, cache, tree, committed)
        path = tree.path_to(tree.size - 1)
        forward.commit(cache, path)
        committed += len(path)
    forward.extend(model, cache, [1, 2, 3])
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, (x for s in snaps for x in s.arrays())))
    for c, m in zip(cache, marks):
        c.rewind(m)
    after = [np.array(a) for s in snapshot_all(cache, len(prompt)) for a in s.arrays()]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("compiled", [True, False])
def test_layers_committed_together_equal_each_committed_alone(tiny_qwen35, compiled, monkeypatch):
    """commit_all runs the GDN layers' commits as one (their heads and channels side by side); the
    states it leaves are bitwise each layer's own commit's, round after round of random trees."""
    from engine import cache as cache_module

    monkeypatch.setattr(GDNCache, "compile_commit", compiled)
    monkeypatch.setattr(GDNCache, "fold_commits", False)
    model = load_model(tiny_qwen35, "float32").model
    rng = np.random.default_rng(11)
    prompt = [int(t) for t in rng.integers(0, 500, size=9)]
    caches = []
    for _ in range(2):
        c = model.make_cache()
        forward.extend(model, c, prompt)
        caches.append(c)
    together: list[set[int]] = []  # what each joint commit committed
    real = cache_module._commit_together

    def recorded(cache, path):
        together.append(real(cache, path))
        return together[-1]

    monkeypatch.setattr(cache_module, "_commit_together", recorded)
    committed = len(prompt)
    for _ in range(5):
        tree = random_tree(rng, int(rng.integers(0, 500)), int(rng.integers(1, 10)), 512, [])
        path = tree.path_to(int(rng.integers(0, tree.size)))
        for joint, c in zip((False, True), caches, strict=True):
            monkeypatch.setattr(cache_module, "COMMIT_TOGETHER", joint)
            forward.verify(model, c, tree, committed)
            forward.commit(c, path)
        committed += len(path)
        for a, b in zip(*caches, strict=True):
            for x, y in zip(a.snapshot(committed).arrays(), b.snapshot(committed).arrays(), strict=True):
                assert np.array_equal(np.array(x), np.array(y))
    gdn = sum(isinstance(c, GDNCache) for c in caches[0])
    assert any(len(ids) == gdn for ids in together), "the joint commit ran"
