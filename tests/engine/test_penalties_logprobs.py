"""Presence/frequency penalties and logprobs go through the same loop: speculation leaves them
unchanged, and logprobs are the model's own log-softmax."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from tests.engine.test_lossless import OracleDrafter
from tests.helpers import generate

FULL_TREES = SpecConfig(method="none", budget=8, max_depth=4, adaptive=False)


@pytest.fixture(scope="module")
def engine(tiny_qwen35):
    # fp32 on a GPU too: in bf16 a tree's rows may round a near-tie the other way (the lossless rule)
    return Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))


def run(engine, prompt, sampling, spec=None):
    out = generate(engine, prompt, sampling, spec)
    return out.tokens, out.logprobs


def run_drafted(engine, prompt, sampling, reference):
    """With speculation that cannot miss: an oracle drafter proposes the plain output (a chain, and
    a fan of wrong siblings around it), so every node's adjusted logits are used, and the drafts
    must actually be taken."""
    outs = []
    for drafter in (OracleDrafter(reference, len(prompt)), OracleDrafter(reference, len(prompt), fan=3)):
        out = generate(engine, prompt, sampling, FULL_TREES, drafter)
        assert out.stats.accepted > 0
        outs.append((out.tokens, out.logprobs))
    assert outs[0][0] == outs[1][0]
    return outs[0]


PROMPT = [int(t) for t in np.random.RandomState(11).randint(0, 500, size=6)] * 4


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, seed=5, frequency_penalty=0.8),
    SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, top_k=20, top_p=0.8, seed=5,
                   repetition_penalty=1.1),
], ids=["greedy", "seeded", "greedy-repetition", "seeded-repetition"])
def test_penalties_are_lossless_and_matter(engine, sampling):
    plain, _ = run(engine, PROMPT, sampling)
    spec, _ = run(engine, PROMPT, sampling, SpecConfig(method="ngram", budget=8, max_depth=4, adaptive=False))
    assert spec == plain
    assert run_drafted(engine, PROMPT, sampling, plain)[0] == plain
    unpenalized, _ = run(engine, PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                         temperature=sampling.temperature, seed=sampling.seed))
    assert unpenalized != plain


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=40, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(max_tokens=40, ignore_eos=True, logit_bias=((77, 3.0),), presence_penalty=0.6),
], ids=["repetition-frequency", "bias-presence"])
def test_penalties_on_the_device_choose_what_the_host_does(engine, sampling):
    # a request for logprobs takes the host's path (its logits reach the host); without, the bias
    # and penalties are applied on the device (engine/device_penalties.py): greedy, in float32 on
    # the test model, the same tokens, with and without speculation
    host, _ = run(engine, PROMPT, dataclasses.replace(sampling, logprobs=1))
    device, _ = run(engine, PROMPT, sampling)
    assert device == host
    assert run(engine, PROMPT, sampling, SpecConfig(method="ngram", budget=8, max_depth=4, adaptive=False))[0] == host


def test_logprobs_are_the_models_log_softmax(engine):
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    tokens, lps = run(engine, PROMPT, sampling)
    assert [lp.token_id for lp in lps] == tokens
    model = engine.model
    cache = model.make_cache()
    logits = np.array(model(mx.array([PROMPT + tokens[:-1]]), cache)[0], dtype=np.float64)
    rows = logits[len(PROMPT) - 1 :]
    ref = rows - np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1, keepdims=True)) - rows.max(-1, keepdims=True)
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - ref[i, tokens[i]]) < 1e-4
        assert len(lp.top) == 3 and lp.top[0][0] == int(np.argmax(ref[i]))
    spec_tokens, spec_lps = run_drafted(engine, PROMPT, sampling, tokens)
    assert spec_tokens == tokens
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lps, spec_lps)) < 1e-4


def test_logit_bias_forces_and_bans_losslessly(engine):
    forced = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((77, 100.0),))
    assert run(engine, PROMPT, forced)[0] == [77] * 6
    plain, _ = run(engine, PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    banned = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=3,
                            logit_bias=tuple((t, -100.0) for t in sorted(set(plain))[:3]))
    out, _ = run(engine, PROMPT, banned)
    assert not set(out) & set(sorted(set(plain))[:3])
    assert run(engine, PROMPT, banned, SpecConfig(method="ngram", budget=8, max_depth=4, adaptive=False))[0] == out
    assert run_drafted(engine, PROMPT, banned, out)[0] == out
