"""Prefix cache: identical outputs with it on and off, reuse across turns, a byte budget that
holds, and no corrupt snapshot after a cancelled request."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from engine.prefix_cache import PrefixCache
from tests.helpers import generate

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)


def engine_for(path, on: bool, budget: int = 1 << 30) -> Engine:
    return Engine(EngineConfig(model_path=str(path), prefill_chunk=16, prefix_cache=on, prefix_cache_bytes=budget))


def run(engine, prompt, sampling, spec=None, cancel_after=None):
    out = generate(engine, prompt, sampling, spec, cancel_after=cancel_after)
    return out.tokens, out.stats


@pytest.fixture(scope="module")
def engines(tiny_qwen35):
    return engine_for(tiny_qwen35, True), engine_for(tiny_qwen35, False)


PROMPT = [int(t) for t in np.random.RandomState(4).randint(0, 500, size=40)]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_same_output_with_and_without_cache(engines, sampling, method):
    on, off = engines
    spec = SpecConfig(method=method, budget=8, max_depth=4, adaptive=False)
    ref, _ = run(off, PROMPT, sampling, spec)
    first, s1 = run(on, PROMPT, sampling, spec)
    again, s2 = run(on, PROMPT, sampling, spec)  # fully cached prompt
    longer, s3 = run(on, PROMPT + [5, 6, 7], sampling, spec)  # extends a stored prefix
    assert first == ref and again == ref
    assert longer == run(off, PROMPT + [5, 6, 7], sampling, spec)[0]
    assert s2.cached_tokens == len(PROMPT) - 1
    assert s3.cached_tokens >= len(PROMPT) - 1
    _, s_off = run(off, PROMPT, sampling, spec)
    assert s_off.cached_tokens == 0


def test_next_chat_turn_reuses_previous(tiny_qwen35):
    from server.chat import ChatRenderOptions, ChatTemplate

    engine = engine_for(tiny_qwen35, True)
    template = ChatTemplate(engine.tokenizer.chat_template)
    opts = ChatRenderOptions(enable_thinking=False)
    msgs = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "def add(a, b):"}]
    turn1 = engine.tokenizer.encode(template.render(msgs, opts))
    out, _ = run(engine, turn1, SamplingParams(max_tokens=12))
    msgs += [{"role": "assistant", "content": engine.tokenizer.decode(out)}, {"role": "user", "content": "again"}]
    turn2 = engine.tokenizer.encode(template.render(msgs, opts))
    second, stats = run(engine, turn2, SamplingParams(max_tokens=16))
    # at least the system + first user message come from the cache
    head = template.render(msgs[:2], opts).split("<|im_start|>assistant")[0]
    assert stats.cached_tokens >= len(engine.tokenizer.encode(head))
    # and the answer resumed from them is the answer of a cold prefill
    assert second == run(engine_for(tiny_qwen35, False), turn2, SamplingParams(max_tokens=16))[0]


def test_budget_is_respected(tiny_qwen35):
    engine = engine_for(tiny_qwen35, True, budget=200_000)
    for seed in range(12):
        prompt = [int(t) for t in np.random.RandomState(100 + seed).randint(0, 500, size=30)]
        run(engine, prompt, GREEDY)
        assert engine.prefix.nbytes <= 200_000
        assert engine.prefix.nbytes == sum(s.nbytes for s in engine.prefix.entries.values())
    assert 0 < len(engine.prefix.entries) < 24  # evicted, not grown


def test_cancelled_request_leaves_no_corrupt_snapshot(engines):
    on, off = engines
    prompt = PROMPT[:25]
    for cancel_after in (0, 3, 7):
        run(on, prompt, GREEDY, cancel_after=cancel_after)
        run(on, prompt, SAMPLED, SpecConfig(method="ngram", adaptive=False), cancel_after=cancel_after)
    assert run(on, prompt, GREEDY)[0] == run(off, prompt, GREEDY)[0]
    assert run(on, prompt, SAMPLED)[0] == run(off, prompt, SAMPLED)[0]


def test_disabled_stores_nothing():
    cache = PrefixCache(1 << 20, enabled=False)
    assert cache.lookup([1, 2, 3]) == (None, 0)


def test_periodic_snapshots_let_an_edited_end_resume(tiny_qwen35):
    """A long prompt whose end changes resumes from the last snapshot before the change
    (engine/prefill.py: every `snapshot_every` tokens), with the same output as a cold run."""
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, snapshot_every=32))
    cold = engine_for(tiny_qwen35, False)
    long = [int(t) for t in np.random.RandomState(9).randint(20, 500, size=150)]
    run(engine, long, GREEDY)
    edited = long[:-5] + [7, 8, 9]
    tokens, stats = run(engine, edited, GREEDY)
    assert stats.cached_tokens == 128  # the last multiple of 32 before the edit
    assert tokens == run(cold, edited, GREEDY)[0]


def test_the_draft_model_resumes_from_its_own_prefix_cache(tiny_qwen35, tiny_draft):
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16,
                                 spec=SpecConfig(method="draft", draft_model=str(tiny_draft), adaptive=False)))
    cold = engine_for(tiny_qwen35, False)
    spec = SpecConfig(method="draft", draft_model=str(tiny_draft), budget=6, max_depth=4, adaptive=False)
    first, _ = run(engine, PROMPT, GREEDY, spec)
    draft_prefix = engine.draft_prefiller(engine.draft_model(str(tiny_draft))).prefix
    snapshot, length = draft_prefix.lookup(PROMPT[:-1])
    assert snapshot is not None and length == len(PROMPT) - 1  # stored by the first request's prefill
    again, stats = run(engine, PROMPT, GREEDY, spec)
    assert again == first == run(cold, PROMPT, GREEDY)[0] and stats.drafted > 0
