"""The one decode loop: every drafter at the edges of max_tokens and of the context, the pipelined
round's bookkeeping, and the stats it reports."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from engine.round import Rounds
from tests.helpers import PARITY_SKIP, generate

METHODS = ["none", "ngram", "draft", "draft-tree", "mtp", "dflash", "dflash:weaver"]
PROMPT = [int(t) for t in np.random.RandomState(4).randint(0, 500, size=9)] * 2


@pytest.fixture(scope="module")
def drafters(request, tiny_qwen35):
    """(target, DFlash dir): the tiny target with an MTP head and a DFlash drafter where the parity
    extra can write them (their PyTorch twins do); else the plain target and None, and the cases of
    the one-pass methods skip while the others run."""
    try:
        return request.getfixturevalue("tiny_qwen35_mtp"), request.getfixturevalue("tiny_dflash")
    except pytest.skip.Exception:
        return tiny_qwen35, None


@pytest.fixture(scope="module")
def engine(drafters):
    target, dflash = drafters
    spec = SpecConfig(dflash_model=str(dflash)) if dflash else SpecConfig()
    return Engine(EngineConfig(model_path=str(target), prefill_chunk=16, max_context=64, spec=spec))


def runs(method: str, drafters) -> None:
    if method.partition(":")[0] in ("mtp", "dflash") and drafters[1] is None:
        pytest.skip(PARITY_SKIP)


def spec(method: str, path, adaptive: bool = False) -> SpecConfig:
    method, _, tree = method.partition(":")
    return SpecConfig(method=method, budget=6, max_depth=4, draft_model=str(path), tree=tree or "ddtree",
                      adaptive=adaptive)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_tokens", [0, 1, 2, 5])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_every_drafter_at_small_max_tokens(engine, drafters, tiny_qwen35, method, max_tokens, temperature):
    runs(method, drafters)
    # Regression: with one token of room the loop skipped propose but still called observe, and
    # the draft drafters crashed (IndexError / ValueError).
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, ignore_eos=True)
    plain = generate(engine, PROMPT, SamplingParams(max_tokens=8, temperature=temperature, seed=7, ignore_eos=True))
    out = generate(engine, PROMPT, sampling, spec(method, tiny_qwen35))
    assert out.tokens == plain.tokens[:max_tokens]
    assert out.finish_reason == "length"


@pytest.mark.parametrize("method", METHODS)
def test_every_drafter_with_one_token_of_room_in_the_context(engine, drafters, tiny_qwen35, method):
    runs(method, drafters)
    prompt = (PROMPT * 4)[:63]  # the context holds 64: one token of room
    out = generate(engine, prompt, SamplingParams(max_tokens=10, ignore_eos=True), spec(method, tiny_qwen35))
    assert len(out.tokens) == 1 and out.finish_reason == "length"
    assert out.tokens == generate(engine, prompt, SamplingParams(max_tokens=10, ignore_eos=True)).tokens


@pytest.mark.parametrize("method", METHODS)
def test_a_stopped_or_cancelled_request_leaves_a_consistent_cache(tiny_qwen35, drafters, method):
    """Whatever ends a request (a stop token, a cancel, the length), the prefix cache stores the
    state of exactly the tokens it holds: the next request resumes from it with the same output."""
    runs(method, drafters)
    target, dflash = drafters
    with_drafters = SpecConfig(dflash_model=str(dflash)) if dflash else SpecConfig()
    on = Engine(EngineConfig(model_path=str(target), prefill_chunk=16, spec=with_drafters))
    off = Engine(EngineConfig(model_path=str(target), prefill_chunk=16, prefix_cache=False,
                              spec=with_drafters))
    reference = generate(off, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True)).tokens
    stop_at = SamplingParams(max_tokens=12, stop_token_ids=(reference[5],), ignore_eos=True)
    stopped = generate(on, PROMPT, stop_at, spec(method, tiny_qwen35))
    assert stopped.tokens == reference[: reference.index(reference[5])] and stopped.finish_reason == "stop"
    generate(on, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), spec(method, tiny_qwen35), cancel_after=1)
    follow = PROMPT + reference[:8]
    expected = generate(off, follow, SamplingParams(max_tokens=6, ignore_eos=True)).tokens
    resumed = generate(on, follow, SamplingParams(max_tokens=6, ignore_eos=True))
    assert resumed.tokens == expected and resumed.stats.cached_tokens >= len(PROMPT)


def test_stats_add_up(engine, tiny_qwen35):
    out = generate(engine, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True), spec("draft", tiny_qwen35))
    s = out.stats
    assert s.generated_tokens == len(out.tokens) == 20
    assert s.accepted == sum(s.accepted_per_pos) > 0  # the target itself as draft: drafts are accepted
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))  # deeper is rarer
    assert s.accepted_per_pos[0] <= s.forward_passes
    assert s.ttft_ms >= s.prompt_ms > 0
    plain = generate(engine, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)).stats
    assert plain.forward_passes == 20 and plain.tokens_per_forward == 1.0 and plain.accepted_per_pos == []
    assert plain.ttft_ms >= plain.prompt_ms > 0  # the pipelined round defines TTFT the same way


def test_an_interrupt_inside_a_pipelined_round_is_not_masked(engine, monkeypatch):
    # Regression: Ctrl-C in `spruce run` printed "KV cache holds 226 tokens, the snapshot key 225":
    # the pipelined loop had committed the next root when the interrupt came, and the prefix-cache
    # store in the loop's cleanup raised over the KeyboardInterrupt.
    real, landed = Rounds.land, []

    def land(self, flight):
        if len(landed) == 3:
            raise KeyboardInterrupt
        landed.append(flight)
        return real(self, flight)

    monkeypatch.setattr(Rounds, "land", land)
    with pytest.raises(KeyboardInterrupt):
        generate(engine, PROMPT + [1], SamplingParams(max_tokens=10, ignore_eos=True))
    monkeypatch.setattr(Rounds, "land", real)
    assert generate(engine, PROMPT + [1], SamplingParams(max_tokens=4, ignore_eos=True)).tokens


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-tree", "mtp", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_adaptive_rounds_are_lossless(engine, drafters, tiny_qwen35, method, temperature, monkeypatch):
    """The controller sizes trees (the root alone included, skipping the drafter, which catches
    up lazily); the output stays the plain output."""
    runs(method, drafters)
    # the n-gram drafter's hindsight says its guesses miss on this model's output, and then no tree
    # is tried (engine/spec_control.py HINDSIGHT_FIRST): told they would hit, the controller climbs
    monkeypatch.setattr("engine.spec_control.SpecController._hinted", lambda self, arm: True)
    sampling = SamplingParams(max_tokens=40, temperature=temperature, seed=3, ignore_eos=True)
    plain = generate(engine, PROMPT, sampling).tokens
    out = generate(engine, PROMPT, sampling, spec(method, tiny_qwen35, adaptive=True))
    assert out.tokens == plain and out.stats.drafted > 0


def test_adaptive_rounds_stop_drafting_when_guesses_miss(engine):
    """An always-wrong drafter: after trying each tree size, the controller keeps the root alone
    (a plain round), drafting again only for its periodic re-tries."""
    from tests.engine.test_lossless import OracleDrafter

    sampling = SamplingParams(max_tokens=44, ignore_eos=True)  # the context holds 64
    plain = generate(engine, PROMPT, sampling).tokens
    wrong = OracleDrafter(plain, len(PROMPT), wrong=True)
    fixed = generate(engine, PROMPT, sampling, SpecConfig(budget=6, max_depth=6, adaptive=False), wrong).stats
    wrong = OracleDrafter(plain, len(PROMPT), wrong=True)
    adaptive = generate(engine, PROMPT, sampling, SpecConfig(budget=6, max_depth=6), wrong)
    assert adaptive.tokens == plain
    assert fixed.forward_passes == 44 and fixed.drafted >= 4 * 44  # a tree every round
    assert adaptive.stats.forward_passes == 44
    assert adaptive.stats.drafted <= fixed.drafted // 3  # the tries and a few re-tries


def test_prompt_time_and_ttft_include_the_drafters_prefill(tiny_qwen35):
    """A draft model prefills the prompt too (drafter.begin): that time is the prompt's, and the time
    to the first token counts it (it was left out of both)."""
    import time

    from engine.drafters.base import NoDrafter

    class SlowBegin(NoDrafter):
        def begin(self, prompt_ids):
            time.sleep(0.2)

    engine = Engine(EngineConfig(model_path=str(tiny_qwen35)))
    out = generate(engine, PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), drafter=SlowBegin())
    assert out.stats.prompt_ms >= 200 and out.stats.ttft_ms >= out.stats.prompt_ms


def test_plain_rounds_chosen_by_the_controller_are_pipelined(engine, monkeypatch):
    """Once the controller settles on the root alone, rounds are queued before the previous one
    lands, as plain decoding's are (else a drafter that never pays still costs the overlap);
    the drafter catches up through skip with the right roots, and the output is plain decoding's."""
    from tests.engine.test_lossless import OracleDrafter

    class WrongButSkips(OracleDrafter):
        """Checks that every skipped round is told its real root (the last token before it)."""

        def begin(self, prompt_ids):
            super().begin(prompt_ids)
            self.last, self.bad_roots, self.skips = prompt_ids[-1], 0, 0

        def observe(self, emitted):
            super().observe(emitted)
            self.last = emitted[-1]

        def skip(self, root, emitted):
            self.skips += 1
            self.bad_roots += root != self.last
            self.observe(emitted)

    sampling = SamplingParams(max_tokens=44, ignore_eos=True)
    plain = generate(engine, PROMPT, sampling).tokens
    ahead = []
    real = Rounds.launch_after
    monkeypatch.setattr(Rounds, "launch_after", lambda self, f: ahead.append(1) or real(self, f))
    wrong = WrongButSkips(plain, len(PROMPT), wrong=True)
    out = generate(engine, PROMPT, sampling, SpecConfig(budget=6, max_depth=6), wrong)
    assert out.tokens == plain
    assert len(ahead) >= 20, len(ahead)  # most of the 44 rounds, after the tries
    assert wrong.skips >= len(ahead) and wrong.bad_roots == 0


@pytest.mark.parametrize("alone", [True, False])
def test_the_plain_round_after_a_tree_lands_before_the_next_is_queued(engine, monkeypatch, alone):
    """On the CPU with a drafter on, the plain round right after a tree is landed before the round
    after it is queued (engine/round.py RESTART_ALONE_ON_CPU: its gap was the p99 where guesses
    miss); the rounds after it are queued ahead again. The output is plain decoding's either way."""
    import mlx.core as mx

    from engine import round as round_mod
    from engine import spec_control
    from tests.engine.test_lossless import OracleDrafter

    class WrongSkips(OracleDrafter):
        def skip(self, root, emitted):
            self.observe(emitted)

    monkeypatch.setattr(round_mod, "RESTART_ALONE_ON_CPU", alone)
    # a four-node tree every sixth round (asked before the round before it lands, and at its launch)
    monkeypatch.setattr(spec_control.SpecController, "budget", lambda self: 4 if self.rounds % 6 in (4, 5) else 0)
    behind: list[bool] = []  # for each round queued ahead: whether the round it was queued behind is a restart
    landed: list[bool] = []
    real_after, real_land = Rounds.launch_after, Rounds.land
    monkeypatch.setattr(Rounds, "launch_after", lambda self, f: behind.append(f.restart) or real_after(self, f))
    monkeypatch.setattr(Rounds, "land", lambda self, f: landed.append(f.restart) or real_land(self, f))
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = generate(engine, PROMPT, sampling).tokens
    behind.clear()
    landed.clear()
    wrong = WrongSkips(plain, len(PROMPT), wrong=True)
    out = generate(engine, PROMPT, sampling, SpecConfig(budget=6, max_depth=6), wrong)
    assert out.tokens == plain
    assert landed.count(True) >= 3 and len(behind) >= 10, (landed.count(True), len(behind))
    assert any(behind) == (not alone or mx.default_device() != mx.cpu)
