"""The real drafters (n-gram, draft model) behind the same loop: lossless, and they do draft."""

from __future__ import annotations

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
    return Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16))


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


def test_ngram_hindsight_is_whether_the_one_guess_tree_would_have_gained():
    # a twin drafter proposes the one-guess tree before each round; the other is told the round
    # with skip: its hindsight counts the rounds where that tree's guess was the emitted token
    rng = np.random.RandomState(0)
    told, twin = NgramDrafter(), NgramDrafter()
    context = [int(t) for t in rng.randint(0, 6, size=30)]  # six ids: guesses hit often
    told.begin(context)
    twin.begin(context)
    expected = 0
    for _ in range(200):
        root = twin.ctx[-1]
        tree = twin.propose(root, budget=1, max_depth=6)
        token = int(rng.randint(0, 6))
        expected += tree.size == 2 and tree.tokens[1] == token
        twin.observe([token])
        told.skip(root, [token])
    assert 0 < expected < 200
    assert told.hindsight() == (expected, 200)
    assert told.hindsight() == (0, 0)  # counted since the last call
    told.skip(told.ctx[-1], [1])
    told.begin(context)  # a new generation starts the count again
    assert told.hindsight() == (0, 0)


def test_the_controller_is_told_the_hindsight_of_every_plain_round(engine, monkeypatch):
    import engine.round as rounds

    seen, plain = [], []
    real_observe, real_record = rounds.SpecController.observe, rounds.SpecController.record

    def observe(self, hits, checked):
        seen.append((hits, checked))
        real_observe(self, hits, checked)

    def record(self, budget, tokens, ms):
        plain.append(budget == 0)
        real_record(self, budget, tokens, ms)

    monkeypatch.setattr(rounds.SpecController, "observe", observe)
    monkeypatch.setattr(rounds.SpecController, "record", record)
    prompt = [int(t) for t in np.random.RandomState(5).randint(0, 500, size=24)]  # guesses miss: plain rounds
    sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    out = generate(engine, prompt, sampling, SpecConfig(method="ngram"))
    assert out.tokens == generate(engine, prompt, sampling).tokens
    assert sum(plain) >= 10
    # one check a plain round, handed over as it lands
    assert sum(checked for _, checked in seen) == sum(plain)


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
