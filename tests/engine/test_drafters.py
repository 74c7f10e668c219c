"""The real drafters (n-gram, draft model) behind the same loop: lossless, and they do draft."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters.ngram import NgramDrafter
from engine.generate import Engine
from tests.helpers import checkpoint_maker, generate

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=48, temperature=0.8, top_k=40, seed=99, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_qwen35):
    # float32 on every backend: these tests demand identity with plain decoding, which the bf16 a GPU
    # engine defaults to does not promise (a multi-row verify may round a near-tie the other way)
    return Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))


def repetitive_prompt(seed: int) -> list[int]:
    rng = np.random.RandomState(seed)
    motif = list(rng.randint(0, 500, size=7))
    return [int(t) for t in motif * 4 + list(rng.randint(0, 500, size=5)) + motif[:3]]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_ngram_lossless(engine, sampling):
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        plain = generate(engine, prompt, sampling).tokens
        fast = generate(engine, prompt, sampling, SpecConfig(method="ngram", budget=10, max_depth=6, adaptive=False))
        spec_out, stats = fast.tokens, fast.stats
        assert spec_out == plain
        assert stats.drafted > 0


def test_ngram_builds_branches():
    d = NgramDrafter(max_ngram=2)
    d.begin([1, 2, 3, 9, 1, 2, 4, 7, 1, 2])  # "1 2" was followed by 3 and by 4
    tree = d.propose(2, budget=8, max_depth=3)
    assert tree.tokens[0] == 2
    assert set(tree.tokens[i] for i in tree.children(0)) == {3, 4}
    assert tree.size <= 9
    d.observe([4, 7])
    assert d.ctx[-2:] == [4, 7]



def trie_by_scan(root: int, continuations: list[list[int]], budget: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The n-gram drafter's trie built the obvious way: each token's child looked for among the
    nodes so far."""
    tokens, parents = [root], [-1]
    for cont in continuations:
        node = 0
        for t in cont:
            child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == t), None)
            if child is None:
                if len(tokens) > budget:
                    break
                tokens.append(t)
                parents.append(node)
                child = len(tokens) - 1
            node = child
    return tuple(tokens), tuple(parents)


@pytest.mark.parametrize("seed", range(6))
def test_ngram_trie_equals_its_scanning_twin(seed):
    rng = np.random.RandomState(seed)
    d = NgramDrafter(max_sites=int(rng.randint(1, 9)))
    d.begin([int(t) for t in rng.randint(0, 6, size=300)])  # a small vocabulary: many shared prefixes
    for _ in range(20):
        budget, depth = int(rng.randint(0, 33)), int(rng.randint(1, 9))
        tree = d.propose(int(d.ctx[-1]), budget, depth)
        assert (tree.tokens, tree.parents) == trie_by_scan(d.ctx[-1], d.continuations(depth), budget)
        d.observe([int(t) for t in rng.randint(0, 6, size=3)])

def accepted_tokens(tree, future: list[int]) -> int:
    """What a round with `tree` emits where the tokens after its root are `future`: its path
    along them, and the token after."""
    node, n = 0, 1
    for t in future:
        node = next((c for c in tree.children(node) if tree.tokens[c] == t), -1)
        if node < 0:
            break
        n += 1
    return n


@pytest.mark.parametrize("ids", [6, 40])
def test_ngram_hindsight_is_what_each_watched_tree_would_have_emitted(ids):
    # a twin drafter proposes each watched tree before each round; the other is told the rounds
    # with skip: its hindsight is what a round with each tree would have emitted, once known.
    # Six ids: guesses hit often; forty: mostly the first token misses, and the watched tree is
    # never built (a hit among them builds it)
    rng = np.random.RandomState(0)
    told, twin = NgramDrafter(), NgramDrafter()
    context = [int(t) for t in rng.randint(0, ids, size=30)]
    tokens = [int(t) for t in rng.randint(0, ids, size=200)]
    told.begin(context)
    twin.begin(context)
    told.watch([1, 4, 16], max_depth=6)
    expected = []
    for i, token in enumerate(tokens):
        root = twin.ctx[-1]
        expected += [(b, accepted_tokens(twin.propose(root, b, 6), tokens[i:] + [-1]), twin.evidence())
                     for b in (1, 4, 16)]
        twin.observe([token])
        told.skip(root, [token])
    told.observe([-1])  # a token no tree holds: every watched tree's outcome is known now
    seen = told.hindsight()
    # every round's outcome for every watched budget (in the order they became known)
    assert sorted(seen) == sorted(expected)
    assert any(n > (2 if ids == 6 else 1) for _, n, _ in seen) and any(n == 1 for _, n, _ in seen)
    if ids == 6:
        assert {e for _, _, e in seen} == {0, 1}  # rounds of both evidence classes
    assert told.hindsight() == []  # handed over once
    told.begin(context)  # a new generation starts again
    assert told.hindsight() == [] and told.watched == []
    told.watch([], max_depth=6)  # watching nothing checks nothing
    told.skip(told.ctx[-1], [1])
    assert told.watched == [] and told.hindsight() == []


def test_the_controller_is_told_the_hindsight_of_every_plain_round(engine, monkeypatch):
    import engine.round as rounds

    seen, plain = [], []
    real_observe, real_record = rounds.SpecController.observe, rounds.SpecController.record

    def observe(self, outcomes):
        seen.extend(outcomes)
        real_observe(self, outcomes)

    def record(self, budget, tokens, ms, rows=None):
        plain.append(budget == 0)
        real_record(self, budget, tokens, ms, rows)

    monkeypatch.setattr(rounds.SpecController, "observe", observe)
    monkeypatch.setattr(rounds.SpecController, "record", record)
    prompt = [int(t) for t in np.random.RandomState(5).randint(0, 500, size=24)]  # guesses miss: plain rounds
    sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    spec = SpecConfig(method="ngram")
    out = generate(engine, prompt, sampling, spec)
    assert out.tokens == generate(engine, prompt, sampling).tokens
    assert sum(plain) >= 10
    # each of the controller's trees, once a plain round, handed over as its outcome is known (the
    # last few rounds' may still be open when the request ends)
    for budget in (1, 4, spec.budget):
        assert sum(plain) - (spec.max_depth + 1) <= sum(b == budget for b, _ in seen) <= sum(plain)


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_the_controller_is_told_the_targets_confidence_at_every_token(tiny_qwen35, sampling, on_device, monkeypatch):
    """Without hindsight the controller's gate reads the probability of the target's most likely
    token at each emitted position: what plain decoding's logprobs say there. The n-gram drafter
    has hindsight and is not told."""
    import engine.round as rounds

    told: list[float] = []
    real = rounds.SpecController.confide

    def confide(self, probabilities):
        told.extend(probabilities)
        real(self, probabilities)

    monkeypatch.setattr(rounds.SpecController, "confide", confide)
    monkeypatch.setattr(rounds, "TOP_ON_DEVICE", on_device)
    # float32: plain decoding with logprobs samples on the host, the speculative run on the device,
    # and only in float32 are their seeded draws the same tokens on every backend
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))
    prompt = repetitive_prompt(2)
    plain = generate(engine, prompt, replace(sampling, logprobs=1))
    top = [float(np.exp(lp.top[0][1])) for lp in plain.logprobs]
    spec = SpecConfig(method="draft", budget=6, max_depth=4, draft_model=str(tiny_qwen35))
    out = generate(engine, prompt, sampling, spec)
    assert out.tokens == plain.tokens and out.stats.drafted > 0
    assert out.stats.accepted > 0 or not sampling.greedy  # greedy: the target's own guesses are right
    assert np.allclose(told[: len(top)], top, rtol=1e-4, atol=1e-6) and len(told) >= len(top)
    told.clear()
    generate(engine, prompt, sampling, SpecConfig(method="ngram"))
    assert told == []


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """An unrelated 2-layer hybrid model with the same tokenizer."""
    small = tmp_path_factory.mktemp("draft_small")
    checkpoint_maker().main([str(small), "--layers", "2", "--full-every", "2", "--hidden", "32", "--seed", "9"])
    return small


@pytest.mark.parametrize("method", ["draft", "draft-tree"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_draft_model_lossless(engine, tiny_qwen35, small_draft, sampling, method):
    prompt = repetitive_prompt(5)
    plain = generate(engine, prompt, sampling).tokens
    for draft in (small_draft, tiny_qwen35):  # an unrelated small model, and the target itself
        fast = generate(engine, prompt, sampling,
                        SpecConfig(method=method, budget=12, max_depth=5, draft_model=str(draft), adaptive=False))
        stats = fast.stats
        assert fast.tokens == plain
    assert stats.drafted > 0  # (an unrelated random draft may be too unsure to draft at all)
    if sampling.greedy:  # the target as its own drafter: its top choices are right
        assert stats.tokens_per_forward > 3


def test_draft_without_model_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="needs a draft model"):
        generate(engine, [1, 2, 3], GREEDY, SpecConfig(method="draft", adaptive=False))
