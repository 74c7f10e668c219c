"""The CPU's one-operation MTP chain draft (engine/cpu_ext.cpp mtp_chain, engine/drafters/mtp_steps.py
CpuChain) against its twin, the depth-by-depth loop over the compiled steps, on random inputs:
the same top-k ids and log-probabilities (to float rounding) at every depth, the same stop rule,
with and without a draft vocabulary, over committed rows on both sides of a KV buffer step; and
whole generations whose drafts match round by round and whose output equals plain decoding."""

from __future__ import annotations

import math
import zlib

import mlx.core as mx
import numpy as np
import pytest

from engine import cpu_ext
from engine.cache import KV_STEP
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.drafters import BUILDERS, mtp
from engine.drafters.draft_vocab import DenseRows, output_projection
from engine.drafters.marginals import Marginals
from engine.drafters.mtp import MTPConfig, MTPDrafter
from engine.drafters.mtp_steps import CompiledSteps, CpuChain
from engine.generate import Engine
from tests.helpers import generate

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu or cpu_ext.module() is None,
                                reason="the engine's CPU operations are built on Linux with a C++ compiler")


@pytest.fixture(scope="module")
def engine(tiny_qwen35_mtp):
    return Engine(EngineConfig(model_path=str(tiny_qwen35_mtp), prefill_chunk=16))


def loop_draft(logits, embed, head, cache, y, depth: int, k: int, log_min_path: float, vocab=None) -> Marginals:
    """MTPDrafter's depth-by-depth draft over the compiled steps (its CPU path without the operation)."""
    depths = CompiledSteps(logits, embed, head, depth - 1, vocab).begin(cache, k)
    ids, logp, path = [], [], 0.0
    for d in range(depth):
        read = depths.read(y)
        ids.append(np.array(read.ids))
        logp.append(np.array(read.logp))
        path += float(logp[-1][0])
        if d + 1 == depth or path < log_min_path:
            break
        y = depths.advance(read.token, y)
    depths.close()
    return Marginals(np.stack(ids), np.stack(logp))


def assert_same_draft(got: tuple[np.ndarray, np.ndarray], want: Marginals) -> None:
    ids, logp = got
    assert ids.shape == want.ids.shape
    np.testing.assert_allclose(logp, want.logp, atol=2e-4)
    np.testing.assert_array_equal(ids, want.ids)


@pytest.mark.parametrize("context", [1, 37, KV_STEP + 5])
@pytest.mark.parametrize("vocab", [False, True], ids=["full", "draft-vocab"])
def test_one_operation_drafts_what_the_loop_drafts(engine, context, vocab):
    rng = np.random.default_rng(context + 1000 * vocab)
    head, target = engine.mtp_head(), engine.model
    embed = target.model.embed_tokens
    H, V = target.args.hidden_size, target.args.vocab_size
    cache = head.make_cache()
    e, h = (mx.array(rng.standard_normal((1, context, H)).astype(np.float32)) for _ in range(2))
    y = head(e, h, cache)[:, -1:]  # the committed rows, as a catch-up writes them
    mx.eval(y, [a for c in cache for a in c.arrays()])
    rows = output_projection(target).weight  # the lm_head's rows: the embedding's where tied
    if vocab:  # a draft vocabulary: some rows of the output projection, not in id order
        ids = mx.array(rng.permutation(V)[: V // 3].astype(np.int32))
        logits, lm = DenseRows(rows[ids], None), rows[ids]
    else:
        ids, logits, lm = None, target.logits, rows
    chain = CpuChain(head, embed.weight, lm, ids)
    for depth, bound in ((1, -math.inf), (6, -math.inf), (6, math.log(0.02))):
        want = loop_draft(logits, embed, head, cache, y, depth, 8, bound, ids)
        assert_same_draft(chain.draft(y, cache[0], depth, 8, bound, []), want)
    assert [c.offset for c in cache] == [context]  # nothing written past the committed rows


def test_built_for_the_plain_head_only(engine):
    head, target = engine.mtp_head(), engine.model
    w = output_projection(target).weight
    assert CpuChain.build(target, head, target.logits, None) is not None
    assert CpuChain.build(target, head, DenseRows(w[:40], mx.zeros((40,))), mx.arange(40)) is None  # a bias
    assert CpuChain.build(target, head, lambda h: h, mx.arange(40)) is None  # rows it cannot read


def test_catch_up_in_the_operation_writes_what_the_head_appends(engine):
    rng = np.random.default_rng(3)
    head, target = engine.mtp_head(), engine.model
    embed = target.model.embed_tokens
    H, V = target.args.hidden_size, target.args.vocab_size
    e, h = (mx.array(rng.standard_normal((1, 29, H)).astype(np.float32)) for _ in range(2))
    caches = []
    for _ in range(2):  # the same committed rows twice
        cache = head.make_cache()
        mx.eval(head(e, h, cache), [a for c in cache for a in c.arrays()])
        caches.append(cache)
    chain = CpuChain(head, embed.weight, output_projection(target).weight, None)
    for T in (1, 5):
        tokens = mx.array(rng.integers(0, V, size=T).astype(np.int32))
        hidden = mx.array(rng.standard_normal((T, H)).astype(np.float32))
        y_want = head.append(embed(tokens[None]), hidden[None], caches[0])
        want = loop_draft(target.logits, embed, head, caches[0], y_want, 6, 8, -math.inf)
        ids, logp, y = chain.draft_after(tokens, hidden, caches[1][0], 6, 8, -math.inf)
        assert_same_draft((ids, logp), want)
        np.testing.assert_allclose(np.array(y), np.array(y_want), atol=1e-4)
        assert caches[0][0].offset == caches[1][0].offset
        for a, b in zip(caches[0][0].snapshot(caches[0][0].offset).arrays(),
                        caches[1][0].snapshot(caches[1][0].offset).arrays(), strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    # the one-guess try's form (MTPDrafter.guess_after): the catch-up and its argmax, lazily
    tokens = mx.array(rng.integers(0, V, size=3).astype(np.int32))
    hidden = mx.array(rng.standard_normal((3, H)).astype(np.float32))
    y_want = head.append(embed(tokens[None]), hidden[None], caches[0])
    guess, y = chain.guess_after(tokens, hidden, caches[1][0])
    assert guess.shape == (1, 1) and int(guess.item()) == int(mx.argmax(target.logits(y_want)[0, 0]).item())
    np.testing.assert_allclose(np.array(y), np.array(y_want), atol=1e-4)
    assert caches[0][0].offset == caches[1][0].offset


class Recorder(MTPDrafter):
    """Records every tree it proposes."""

    def __init__(self, engine: Engine, tree: str, config: MTPConfig) -> None:
        super().__init__(engine.model, engine.mtp_head(), BUILDERS[tree], config)
        assert self.cpu_chain is not None
        self.trees: list[list[int]] = []

    def propose(self, root, budget, max_depth):
        tree = super().propose(root, budget, max_depth)
        self.trees.append([*tree.tokens, *tree.parents])
        return tree


@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_generations_draft_alike_and_equal_plain_decoding(engine, tree, monkeypatch):
    sampling = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    # no top-k: the one-operation chain takes the argmax as the loop does (MTPDrafter._chain_draws)
    assert sampling.top_k == 0 and mtp.COUPLED_DRAWS
    rng = np.random.default_rng(zlib.crc32(tree.encode()))
    prompt = [int(t) for t in rng.integers(0, 500, size=24)]
    spec = SpecConfig(method="mtp", tree=tree, budget=10, max_depth=6, adaptive=False)
    plain = generate(engine, prompt, sampling).tokens
    trees = []
    for one_operation in (True, False):
        monkeypatch.setattr(cpu_ext, "MTP_CHAIN", one_operation)
        drafter = Recorder(engine, tree, MTPConfig(min_path_prob=0.05))
        assert generate(engine, prompt, sampling, spec, drafter).tokens == plain
        trees.append(drafter.trees)
    assert trees[0] == trees[1] and len(trees[0]) > 3  # the same trees, round by round


def coupled_token(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The row a draw at u takes from logits (float64): the top_k rows by logit,
    p = exp((l - max) / t), the top-p cut best first, then the running sum in id order."""
    n = top_k
    order = sorted(range(logits.size), key=lambda i: (-logits[i], i))[:n]
    p = np.exp((logits[order] - logits[order[0]]) / temperature)
    kept = n
    if top_p < 1.0:
        before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
        kept = int(np.argmax(before >= top_p * p.sum())) if (before >= top_p * p.sum()).any() else n
    ranks = sorted(range(kept), key=lambda j: order[j])
    run, mass = 0.0, p[:kept].sum()
    for j in ranks:
        run += p[j]
        if run > u * mass:
            return order[j]
    return order[ranks[-1]]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 20, 0.8), (1.0, 64, 1.0), (1.3, 5, 0.95)])
def test_coupled_chain_token_is_the_draw_at_the_uniform(engine, temperature, top_k, top_p):
    """With uniforms, depth 1's chain token is the head's draw at depth 1's uniform (the cut and the
    running sum in id order), the other top-k rows after it in order; across uniforms it covers the
    head's likely tokens, not only its argmax."""
    rng = np.random.default_rng(7)
    head, target = engine.mtp_head(), engine.model
    embed = target.model.embed_tokens
    H = target.args.hidden_size
    cache = head.make_cache()
    e, h = (mx.array(rng.standard_normal((1, 9, H)).astype(np.float32)) for _ in range(2))
    y = head(e, h, cache)[:, -1:]
    mx.eval(y, [a for c in cache for a in c.arrays()])
    chain = CpuChain(head, embed.weight, output_projection(target).weight, None)
    row = np.array(target.logits(y)[0, 0], dtype=np.float64)
    argmax_ids, _ = chain.draft(y, cache[0], 1, 8, -math.inf, [])
    seen = set()
    for u in np.linspace(0.01, 0.99, 25):
        draws = cpu_ext.ChainDraws(mx.array([u], dtype=mx.float32), temperature, top_k, top_p)
        ids, logp = chain.draft(y, cache[0], 1, 8, -math.inf, [], draws)
        want = coupled_token(row, temperature, top_k, top_p, float(np.float32(u)))
        assert ids[0, 0] == want, u
        rest = [int(t) for t in argmax_ids[0] if t != want]
        assert ids[0, 1:].tolist() == rest[:7]  # the others in order after it
        seen.add(int(ids[0, 0]))
    assert len(seen) > 1


def test_coupled_draws_take_the_uniforms_the_target_draws_with(engine, monkeypatch):
    """Round by round, the chain's depth-d guess is drawn at the uniform the target's draw at the
    chain's depth d - 1 node uses (the root's at depth 1): the positions line up."""
    from engine import device_sampler
    from engine import round as rounds

    sampling = SamplingParams(max_tokens=30, temperature=0.9, top_k=20, top_p=0.95, seed=11, ignore_eos=True)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 500, size=24)]
    spec = SpecConfig(method="mtp", tree="chain", budget=10, max_depth=6, adaptive=False)
    drafted, drawn = [], []
    real_draws, real_choose = MTPDrafter._chain_draws, device_sampler.choose_and_top

    def draws(self, depth):
        out = real_draws(self, depth)
        drafted.append(np.array(out.uniforms))
        return out

    def choose(logits, params, uniforms, *args, **kwargs):
        if logits.shape[0] > 1:  # a tree's rows (a chain: row j at depth j)
            drawn.append(np.array(uniforms))
        return real_choose(logits, params, uniforms, *args, **kwargs)

    monkeypatch.setattr(MTPDrafter, "_chain_draws", draws)
    monkeypatch.setattr(device_sampler, "choose_and_top", choose)
    monkeypatch.setattr(rounds, "DRAW_VISITED_ON_CPU", False)  # a tree's nodes drawn together, with their uniforms
    plain = generate(engine, prompt, sampling).tokens
    assert generate(engine, prompt, sampling, spec).tokens == plain
    assert len(drawn) > 3 and len(drafted) >= len(drawn)
    for d, t in zip(drafted[-len(drawn):], drawn):
        n = min(d.size, t.size - 1)
        assert n >= 1 and np.array_equal(d[:n], t[:n])
