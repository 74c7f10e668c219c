"""MTP drafting's fast paths against their twins, on random inputs (fresh each run):

- the compiled per-depth steps (shape-stable head row over a scratch, engine/drafters/mtp_steps.py)
  against the plain ones through the head's KV cache, for context lengths on both sides of a KV
  buffer step;
- the stop rule (`min_path_prob`): the marginals it keeps are the first rows of a full-depth draft,
  cut at the first depth whose top-1 path probability falls below the bound; and the trees of a
  whole generation are the same with the compiled steps and with the plain ones.
"""

from __future__ import annotations

import math
import zlib

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext
from engine.cache import KV_STEP
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters import BUILDERS
from engine.drafters.marginals import Marginals
from engine.drafters.mtp import MTPConfig, MTPDrafter
from engine.drafters.mtp_steps import CompiledSteps, PlainDepths
from engine.generate import Engine
from tests.helpers import generate


@pytest.fixture(autouse=True)
def depth_by_depth(monkeypatch):
    """The drafts here run depth by depth: on the CPU a whole chain may otherwise be one operation
    of the engine's own (engine/drafters/mtp_steps.py CpuChain), held to this loop in
    tests/engine/test_mtp_chain.py."""
    monkeypatch.setattr(cpu_ext, "MTP_CHAIN", False)


@pytest.fixture(scope="module")
def engine(tiny_qwen35_mtp):
    return Engine(EngineConfig(model_path=str(tiny_qwen35_mtp), prefill_chunk=16))


@pytest.mark.parametrize("context", [1, 37, KV_STEP - 2, KV_STEP + 5])
def test_compiled_steps_equal_plain(engine, context):
    rng = np.random.default_rng(context)
    head, target = engine.mtp_head(), engine.model
    embed = target.model.embed_tokens
    H, D, k = target.args.hidden_size, 5, 8
    cache = head.make_cache()
    e, h = (mx.array(rng.standard_normal((1, context, H)).astype(np.float32)) for _ in range(2))
    y = head(e, h, cache)[:, -1:]  # the committed rows, as a catch-up writes them
    mx.eval(y, [a for c in cache for a in c.arrays()])
    committed = [np.array(a) for c in cache for a in c.snapshot(context).arrays()]
    plain = PlainDepths(target.logits, embed, head, cache, k)
    fast = CompiledSteps(target.logits, embed, head, D - 1).begin(cache, k)
    y_plain = y_fast = y
    for d in range(D):
        a, b = plain.read(y_plain), fast.read(y_fast)
        np.testing.assert_array_equal(np.array(a.ids), np.array(b.ids))
        np.testing.assert_allclose(np.array(a.logp), np.array(b.logp), atol=1e-4)
        assert int(a.token.item()) == int(b.token.item()) == int(a.ids[0].item())
        if d + 1 < D:
            token = mx.array([[int(rng.integers(0, target.args.vocab_size))]])  # any token, the same for both
            y_plain, y_fast = plain.advance(token, y_plain), fast.advance(token, y_fast)
            np.testing.assert_allclose(np.array(y_plain), np.array(y_fast), atol=1e-4)
    plain.close()
    fast.close()
    assert [c.offset for c in cache] == [context] * len(cache)
    for want, got in zip(committed, [np.array(a) for c in cache for a in c.snapshot(context).arrays()]):
        np.testing.assert_array_equal(want, got)


def test_compiled_steps_refuse_rows_past_the_scratch(engine):
    head, target = engine.mtp_head(), engine.model
    cache = head.make_cache()
    H = target.args.hidden_size
    y = head(mx.zeros((1, 3, H)), mx.ones((1, 3, H)), cache)[:, -1:]
    depths = CompiledSteps(target.logits, target.model.embed_tokens, head, 1).begin(cache, 4)
    y = depths.advance(mx.array([[1]]), y)
    with pytest.raises(ValueError, match="more than 1 rows"):
        depths.advance(mx.array([[2]]), y)


class Lockstep(MTPDrafter):
    """Drafts every round twice from the same committed state, as configured and with `other`'s
    steps and stop bound, recording both marginals (a draft leaves the committed state as it was)."""

    def __init__(self, engine: Engine, tree: str, config: MTPConfig, other: MTPConfig) -> None:
        super().__init__(engine.model, engine.mtp_head(), BUILDERS[tree], config)
        self.twin = MTPDrafter(engine.model, engine.mtp_head(), BUILDERS[tree], other)
        self.rounds: list[tuple[Marginals, Marginals]] = []

    def _draft(self, y: mx.array, depth: int, k: int) -> Marginals:
        m = super()._draft(y, depth, k)
        own = self.steps, self.log_min_path, self.sync_each_depth
        self.steps, self.log_min_path, self.sync_each_depth = (self.twin.steps, self.twin.log_min_path,
                                                               self.twin.sync_each_depth)
        try:
            self.rounds.append((m, super()._draft(y, depth, k)))
        finally:
            self.steps, self.log_min_path, self.sync_each_depth = own
        return m


def lockstep(engine, tree: str, config: MTPConfig, other: MTPConfig, sampling: SamplingParams):
    # a seeded prompt: identity with plain decoding holds in float32 up to a sampled token whose
    # uniform falls within float32 rounding of a CDF boundary (a verify folds the GDN state and sums
    # its rows with another kernel than the one-row step); one prompt in 150 drawn this way met one
    # (uniform - CDF = 6.5e-8), and an unseeded prompt made that a failure now and then
    rng = np.random.default_rng(zlib.crc32(f"{tree} {config} {other}".encode()))  # one prompt per case
    prompt = [int(t) for t in rng.integers(0, 500, size=int(rng.integers(3, 40)))]
    drafter = Lockstep(engine, tree, config, other)
    out = generate(engine, prompt, sampling, SpecConfig(method="mtp", tree=tree, budget=10, max_depth=6,
                                                        adaptive=False), drafter)
    assert out.tokens == generate(engine, prompt, sampling).tokens
    assert drafter.rounds
    return drafter.rounds


SAMPLED = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)


@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_stop_rule_cuts_a_full_draft_where_the_top1_path_drops(engine, tree):
    bound = 0.3
    shallower = 0
    for cut, full in lockstep(engine, tree, MTPConfig(min_path_prob=bound), MTPConfig(min_path_prob=0.0), SAMPLED):
        # the full draft's depth is the round's (room shrinks near max_tokens)
        np.testing.assert_array_equal(cut.ids, full.ids[: cut.depth])
        np.testing.assert_allclose(cut.logp, full.logp[: cut.depth], atol=1e-5)
        path = np.cumsum(full.logp[:, 0])
        assert cut.depth == next((d + 1 for d in range(full.depth) if path[d] < math.log(bound)), full.depth)
        shallower += cut.depth < full.depth
    assert shallower > 0  # the rule did cut (random heads are unsure)


@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_compiled_and_plain_steps_draft_the_same(engine, tree):
    config = MTPConfig(min_path_prob=0.05)
    for fast, plain in lockstep(engine, tree, config, MTPConfig(min_path_prob=0.05, compiled=False), SAMPLED):
        np.testing.assert_array_equal(fast.ids, plain.ids)
        np.testing.assert_allclose(fast.logp, plain.logp, atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "plain"])
@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_one_eval_and_a_sync_each_depth_draft_the_same(engine, tree, compiled):
    """All depths queued as one graph and cut by the stop rule afterwards (GPUs) give the marginals
    the depth-by-depth draft gives (the CPU), cut where it stopped."""
    each = MTPConfig(min_path_prob=1e-5, compiled=compiled, sync_each_depth=True)
    once = MTPConfig(min_path_prob=1e-5, compiled=compiled, sync_each_depth=False)
    depths = []
    for a, b in lockstep(engine, tree, each, once, SAMPLED):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.logp, b.logp, atol=1e-6)
        depths.append(a.depth)
    assert len(set(depths)) > 1, depths  # the rule cut drafts at different depths
