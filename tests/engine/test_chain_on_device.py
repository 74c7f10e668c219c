"""Chains drafted on the device (ChainsOnDevice, engine/round.py CHAIN_ON_DEVICE): the round's verify
is queued behind a draft whose tokens never reach the host before it. The GPU's default; forced on
the CPU here, with the bundled target and its trained MTP head and DFlash drafter (fp32), so that
the chains are accepted and the rounds' outcomes say something:

- the chain drafted on the device is the chain builder's tree that `propose` drafts from the same
  state (the MTP head without its stop rule, which needs the marginals on the host);
- output is plain decoding's, greedy and seeded, and the rounds took the device path.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import round as rounds
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters import BUILDERS
from engine.drafters.dflash import DFlashDrafter
from engine.drafters.mtp import MTPConfig, MTPDrafter
from engine.generate import Engine
from server.chat import ChatRenderOptions, ChatTemplate
from tests.helpers import generate

BUNDLED = Path(__file__).resolve().parents[2] / "engine" / "bundled"
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=3, ignore_eos=True)
# the penalties are applied on the device along each node's path, whose tokens are there only
PENALISED = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=3, repetition_penalty=1.1,
                           presence_penalty=0.5, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model_path=str(BUNDLED / "target"), dtype="float32",
                               spec=SpecConfig(dflash_model=str(BUNDLED / "dflash"))))


@pytest.fixture(scope="module")
def prompt(engine):
    template = ChatTemplate(engine.tokenizer.chat_template)
    text = "Write a python function that returns the longest common prefix of a list of strings"
    return engine.tokenizer.encode(template.render([{"role": "user", "content": text}],
                                                   ChatRenderOptions(enable_thinking=False)))


@pytest.fixture
def on_device(monkeypatch):
    monkeypatch.setattr(rounds, "CHAIN_ON_DEVICE", True)


class Checked:
    """Mixed into a drafter: every device chain is checked against `propose` from the same state."""

    chains = 0

    def chain_on_device(self, root, budget, max_depth):
        chain = super().chain_on_device(root, budget, max_depth)  # type: ignore[misc]
        if chain is not None:
            tree = self.propose(root, budget, max_depth)  # type: ignore[attr-defined]
            assert tree.parents == tuple(range(-1, tree.size - 1))  # the chain builder's tree
            assert [root, *np.array(chain).tolist()] == list(tree.tokens)
            self.chains += 1
        return chain


class CheckedMTP(Checked, MTPDrafter):
    pass


class CheckedDFlash(Checked, DFlashDrafter):
    pass


def drafter(engine, method: str):
    if method == "mtp":  # no stop rule: the device chain runs to full depth
        return CheckedMTP(engine.model, engine.mtp_head(), BUILDERS["chain"], MTPConfig(min_path_prob=0.0),
                          top1_chains=True)
    return CheckedDFlash(engine.model, engine.dflash_model(str(BUNDLED / "dflash")), BUILDERS["chain"],
                         top1_chains=True)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_device_chain_is_the_chain_propose_drafts(engine, prompt, on_device, method):
    d = drafter(engine, method)
    out = generate(engine, prompt, GREEDY, SpecConfig(method=method, tree="chain", budget=6, max_depth=6,
                                                      adaptive=False), d)
    assert d.chains > 3
    assert out.stats.tokens_per_forward > 1.5  # the chains were accepted: the rounds say something


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, PENALISED], ids=["greedy", "seeded", "penalised"])
@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_device_chains_are_lossless(engine, prompt, on_device, monkeypatch, method, sampling):
    plain = generate(engine, prompt, sampling).tokens
    calls = []
    real = rounds.Rounds._queue

    def spy(self, tree, tokens, t0, draft_ms):
        calls.append(tree.size > 1 and tokens is not None)
        return real(self, tree, tokens, t0, draft_ms)

    monkeypatch.setattr(rounds.Rounds, "_queue", spy)
    fast = generate(engine, prompt, sampling, SpecConfig(method=method, tree="chain", budget=8, max_depth=6,
                                                         adaptive=False))
    assert fast.tokens == plain
    assert sum(calls) >= len(calls) - 1  # every round but a last one without room drafted on the device
    assert fast.stats.forward_passes < len(plain)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_device_chains_under_the_controller_are_lossless(engine, prompt, on_device, method):
    """The controller sizes each round's chain (and queues its one-guess tree behind plain rounds)."""
    for sampling in (GREEDY, PENALISED):
        plain = generate(engine, prompt, sampling).tokens
        fast = generate(engine, prompt, sampling, SpecConfig(method=method, tree="chain", budget=16, max_depth=8))
        assert fast.tokens == plain


def test_other_trees_and_the_cpu_default_draft_on_the_host(engine, prompt, monkeypatch):
    """DDTree needs the marginals on the host; the CPU does not draft chains on the device unless told."""
    seen = []
    real = rounds.Rounds._queue

    def spy(self, tree, tokens, t0, draft_ms):
        seen.append(tokens is not None and tree.size > 1)
        return real(self, tree, tokens, t0, draft_ms)

    monkeypatch.setattr(rounds.Rounds, "_queue", spy)
    short = SamplingParams(max_tokens=12, ignore_eos=True)
    generate(engine, prompt, short, SpecConfig(method="mtp", tree="ddtree", budget=8, adaptive=False))
    if mx.default_device() == mx.cpu:
        generate(engine, prompt, short, SpecConfig(method="mtp", tree="chain", budget=8, adaptive=False))
    assert seen and not any(seen)
