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
