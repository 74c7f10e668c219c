"""Losslessness: with any drafter, the loop emits exactly what plain decoding emits (fp32).

Adversarial drafters propose random trees, always-wrong, always-right, deep chains and wide
fans; the target must not care. Seeded sampling must match token for token too.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import Engine
from engine.tree import DraftTree
from tests.helpers import generate


@pytest.fixture(scope="module")
def engine(tiny_qwen35):
    return Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))  # fp32 on a GPU too


class OracleDrafter:
    """Knows the plain output: proposes it (right), or its tokens shifted by one (wrong)."""

    def __init__(self, reference: list[int], prompt_len: int, wrong: bool = False, fan: int = 1):
        self.ref, self.wrong, self.fan = reference, wrong, fan
        self.prompt_len = prompt_len

    def begin(self, prompt_ids):
        self.pos = 0

    def propose(self, root, budget, max_depth):
        drafts = self.ref[self.pos : self.pos + min(budget, max_depth)]
        if self.wrong:
            drafts = [(t + 1) % 512 for t in drafts]
        if self.fan == 1 or not drafts:
            return DraftTree.chain(root, drafts)
        # wide fan at the first level (right token last), then the chain below the right one
        first = [(drafts[0] + j) % 512 for j in range(1, self.fan)] + [drafts[0]]
        tokens, parents = [root] + first, [-1] + [0] * len(first)
        for t in drafts[1 : max(1, budget - self.fan + 1)]:
            parents.append(len(tokens) - 1)
            tokens.append(t)
        return DraftTree(tuple(tokens), tuple(parents))

    def observe(self, emitted):
        self.pos += len(emitted)


class RandomTreeDrafter:
    def __init__(self, seed: int, vocab: int, reference: list[int] | None = None):
        self.rng, self.vocab, self.ref = np.random.default_rng(seed), vocab, reference

    def begin(self, prompt_ids):
        self.pos = 0

    def propose(self, root, budget, max_depth):
        n = int(self.rng.integers(0, budget + 1))
        tokens, parents, depth = [root], [-1], [0]
        for _ in range(n):
            p = int(self.rng.integers(0, len(tokens)))
            if depth[p] >= max_depth:
                continue
            # half the time guess the true next token of the reference (so some paths get accepted)
            d = self.pos + depth[p]
            tok = self.ref[d] if self.ref and d < len(self.ref) and self.rng.random() < 0.5 \
                else int(self.rng.integers(0, self.vocab))
            siblings = {tokens[i] for i in range(len(tokens)) if parents[i] == p}
            if tok in siblings:
                continue
            tokens.append(tok)
            parents.append(p)
            depth.append(depth[p] + 1)
        return DraftTree(tuple(tokens), tuple(parents))

    def observe(self, emitted):
        self.pos += len(emitted)


PROMPTS = [[int(t) for t in np.random.RandomState(s).randint(0, 500, size=n)] for s, n in ((1, 30), (2, 5), (3, 50))]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["right", "wrong", "fan", "random", "deep"])
def test_spec_equals_plain(engine, sampling, kind):
    spec = SpecConfig(method="none", budget=12, max_depth=12 if kind == "deep" else 6, adaptive=False)
    for i, prompt in enumerate(PROMPTS):
        plain = generate(engine, prompt, sampling).tokens
        drafter = {
            "right": lambda: OracleDrafter(plain, len(prompt)),
            "wrong": lambda: OracleDrafter(plain, len(prompt), wrong=True),
            "fan": lambda: OracleDrafter(plain, len(prompt), fan=4),
            "random": lambda: RandomTreeDrafter(i, 512, plain),
            "deep": lambda: OracleDrafter(plain, len(prompt)),
        }[kind]()
        assert generate(engine, prompt, sampling, spec, drafter).tokens == plain


def assert_fan_and_random_trees_lossless(engine, sampling, kind):
    """Wide fans (`fan`) or random trees (`random`) around plain decoding's tokens, every prompt:
    speculation emits exactly plain decoding's tokens."""
    spec = SpecConfig(method="none", budget=12, max_depth=6, adaptive=False)
    for i, prompt in enumerate(PROMPTS):
        plain = generate(engine, prompt, sampling).tokens
        drafter = OracleDrafter(plain, len(prompt), fan=4) if kind == "fan" else RandomTreeDrafter(i, 512, plain)
        assert generate(engine, prompt, sampling, spec, drafter).tokens == plain


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["fan", "random"])
def test_commits_folded_into_the_next_verify_change_no_token(engine, sampling, kind, monkeypatch):
    """The GPU's way of committing (the accepted path recorded, folded in by the next verify; see
    GDNCache), forced on the CPU's ops core: plain decoding's tokens, and the fold really ran."""
    from engine.cache import GDNCache

    folds = []
    settle_with = GDNCache.settle_with  # called when a verify hands back the states after its fold
    monkeypatch.setattr(GDNCache, "fold_commits", True)
    monkeypatch.setattr(GDNCache, "settle_with", lambda self, *a: folds.append(1) or settle_with(self, *a))
    assert_fan_and_random_trees_lossless(engine, sampling, kind)
    assert folds


def test_right_drafter_needs_fewer_forwards(engine):
    prompt = PROMPTS[0]
    plain = generate(engine, prompt, GREEDY).tokens
    out = generate(engine, prompt, GREEDY, SpecConfig(budget=8, max_depth=8, adaptive=False),
                   OracleDrafter(plain, len(prompt)))
    stats = out.stats
    assert out.tokens == plain
    assert stats.forward_passes <= len(plain) // 8 + 1
    assert stats.tokens_per_forward > 7


@pytest.mark.parametrize("visited", [True, False], ids=["draw-visited-nodes", "draw-every-node"])
@pytest.mark.parametrize("kind", ["right", "random"])
def test_seeded_trees_drawn_node_by_node_or_all_at_once(engine, kind, visited, monkeypatch):
    """A sampled tree's tokens drawn as the walk visits each node (the CPU's way) or for every node
    in the verify's graph (the GPU's): both emit plain decoding's tokens."""
    from engine import round as rounds

    monkeypatch.setattr(rounds, "DRAW_VISITED_ON_CPU", visited)
    spec = SpecConfig(method="none", budget=12, max_depth=6, adaptive=False)
    for i, prompt in enumerate(PROMPTS):
        plain = generate(engine, prompt, SAMPLED).tokens
        drafter = OracleDrafter(plain, len(prompt)) if kind == "right" else RandomTreeDrafter(i, 512, plain)
        assert generate(engine, prompt, SAMPLED, spec, drafter).tokens == plain


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_spec_stops_where_plain_stops(engine, sampling):
    """Stop tokens on: a stop token the target chooses inside an accepted draft ends the answer at
    the same place as plain decoding, though the drafter offers the text that follows it."""
    prompt = PROMPTS[0]
    free = generate(engine, prompt, sampling).tokens
    stop = free[len(free) // 2]  # a token the answer reaches half-way (or earlier)
    stopped = dataclasses.replace(sampling, ignore_eos=False, stop_token_ids=(stop,))
    plain = generate(engine, prompt, stopped)
    assert plain.finish_reason == "stop" and len(plain.tokens) < len(free)
    spec = SpecConfig(method="none", budget=8, max_depth=8, adaptive=False)
    for drafter in (OracleDrafter(free, len(prompt)), OracleDrafter(free, len(prompt), fan=3)):
        out = generate(engine, prompt, stopped, spec, drafter)
        assert (out.tokens, out.finish_reason) == (plain.tokens, "stop")
        assert out.stats.accepted > 0 or len(plain.tokens) < 2


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_spec_grows_the_kv_cache_past_its_first_block(engine, sampling):
    """The attention K/V grows in blocks of KV_STEP rows: trees verified across the boundary, and
    commits after it, must not change the output."""
    from engine.cache import KV_STEP

    prompt = [int(t) for t in np.random.RandomState(8).randint(0, 500, size=KV_STEP - 20)]
    long = dataclasses.replace(sampling, max_tokens=80)
    plain = generate(engine, prompt, long).tokens
    spec = SpecConfig(method="none", budget=12, max_depth=6, adaptive=False)
    for drafter in (OracleDrafter(plain, len(prompt)), OracleDrafter(plain, len(prompt), fan=4),
                    RandomTreeDrafter(5, 512, plain)):
        out = generate(engine, prompt, long, spec, drafter)
        assert out.tokens == plain and out.stats.accepted > 0
    assert len(prompt) + len(plain) > KV_STEP + 32


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kv", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("rows_op", [True, False], ids=["rows-operation", "widened"])
def test_a_half_kv_cache_keeps_speculation_lossless(tiny_qwen35, sampling, kv, rows_op, monkeypatch):
    """--kv-dtype: K/V rounded to a half (or quantized to 8 bits with a scale a row) as they are
    written, read by the CPU's rows attention in place or widened for MLX's operations (the other
    backends' paths): speculation still emits plain decoding's tokens, the commit included (fans
    and random trees across the first block)."""
    from engine import cpu_ext
    from engine.cache import KV_STEP

    if kv == "int8" and mx.default_device() != mx.cpu:
        pytest.skip("an 8-bit cache is for the CPU backend")
    monkeypatch.setattr(cpu_ext, "ATTENTION", rows_op)
    half = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32", kv_dtype=kv))
    prompt = [int(t) for t in np.random.RandomState(8).randint(0, 500, size=KV_STEP - 20)]
    long = dataclasses.replace(sampling, max_tokens=60)
    plain = generate(half, prompt, long)
    spec = SpecConfig(method="none", budget=12, max_depth=6, adaptive=False)
    for drafter in (OracleDrafter(plain.tokens, len(prompt), fan=4), RandomTreeDrafter(5, 512, plain.tokens)):
        out = generate(half, prompt, long, spec, drafter)
        assert out.tokens == plain.tokens and out.stats.accepted > 0
    caches = [c for c in half.make_cache() if hasattr(c, "offset")]
    assert caches and all(str(c.dtype) == f"mlx.core.{kv}" for c in caches)


@pytest.mark.skipif(__import__("engine.kernels", fromlist=["gpu_backend"]).gpu_backend() is None,
                    reason="the fused kernels run on a GPU backend")
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", ["fan", "random"])
@pytest.mark.parametrize("kernel", ["attention", "add_norm", "gated_norm"])
def test_opt_in_kernels_change_no_token(tiny_qwen35, sampling, kind, kernel, monkeypatch):
    """With the attention kernels (engine/attention_rows.py) or a fused norm (engine/fused_norms.py)
    on, for decode steps and tree verifies alike, speculation emits plain decoding's tokens, and
    the kernel ran. A fresh engine each time: the fused norms live inside compiled layer traces,
    which a module-wide engine would have traced (and so called them) in an earlier case only."""
    import engine.attention_rows as attention_kernel
    import engine.fused_norms as fused_norms
    from engine import launch_plan

    monkeypatch.setattr(launch_plan.SWITCH, "value", False)  # its wiring has no pending residual
    module, switch = {"attention": (attention_kernel, attention_kernel.SWITCH),
                      "add_norm": (fused_norms, fused_norms.ADD),
                      "gated_norm": (fused_norms, fused_norms.GATED)}[kernel]
    name = "attention_rows" if kernel == "attention" else kernel
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(switch, "value", True)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))
    assert_fan_and_random_trees_lossless(engine, sampling, kind)
    assert calls


def force_residual_pending(monkeypatch) -> list[int]:
    """The fused residual adds switched on in the layers' traces, on the CPU, with the fused call
    replaced by its twin (the unfused ops) -> a list that grows by one at each call of it."""

    import engine.fused_norms as fused_norms
    from engine import cpu_ext, launch_plan

    monkeypatch.setattr(launch_plan.SWITCH, "value", False)  # on CUDA: its wiring has no pending residual
    calls: list[int] = []

    def twin(x, y, w, eps):
        calls.append(1)
        h = x + y
        return h, cpu_ext.rms_norm(h, w, eps)  # what the layers' RMSNorm runs (on the CPU, its own operation)

    monkeypatch.setattr(fused_norms, "traces", lambda: (True, False))
    monkeypatch.setattr(fused_norms, "add_norm", twin)
    return calls


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_residual_left_pending_changes_no_token(tiny_qwen35, engine, sampling, monkeypatch):
    """With the residual adds fused into the norms after them (engine/fused_norms.py), a layer
    leaves its MLP output pending, added in the next layer's input-norm launch (the last one in the
    final norm's). Forced on the CPU with the fused call replaced by its twin (the same ops), plain
    decoding emits exactly what it emits without, fans and random trees match it, and the pending
    path ran. A fresh engine: the setting is part of the layers' compiled traces."""
    want = [generate(engine, prompt, sampling).tokens for prompt in PROMPTS]
    calls = force_residual_pending(monkeypatch)
    chained = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))
    assert [generate(chained, prompt, sampling).tokens for prompt in PROMPTS] == want
    assert_fan_and_random_trees_lossless(chained, sampling, "fan")
    assert_fan_and_random_trees_lossless(chained, sampling, "random")
    # every layer's post-mixer norm and, from the second layer on, its input norm, then the final norm
    assert len(calls) >= 2 * 4


def test_features_with_the_residual_pending_are_the_sums(tiny_qwen35, monkeypatch):
    """The layers a drafter taps (DFlash) and the final state (MTP) recorded with the MLP outputs
    left pending are bitwise what the unfused model records: a tap adds the pending output first.
    (Forced on the CPU with the fused call's twin, whose ops are the unfused ones.)"""
    import mlx.core as mx

    from engine.feature_cache import FeatureCache, FeatureTaps
    from engine.loader import load_model

    if mx.default_device() != mx.cpu:
        # there the forcing also turns the GPU's gated norm and launch plans off, so the two runs
        # differ by more than the pending residual; the GPU's fused add has its own twin tests
        # (tests/kernels/test_fused_norms.py)
        pytest.skip("the CPU's unfused operations as the twin")
    tokens = mx.array([PROMPTS[0]])

    def recorded() -> np.ndarray:
        model = load_model(tiny_qwen35, "float32").model
        features = FeatureCache(FeatureTaps(final=True, layers=(0, 1, 2)))
        model.hidden(tokens, [*model.make_cache(), features])
        return np.array(features.read(0))

    want = recorded()
    force_residual_pending(monkeypatch)
    got = recorded()
    assert want.shape == got.shape and want.shape[1] == 4 * 64
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("switch", ["SWITCH", "RES"], ids=["all-builds", "residual-builds"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_layers_with_fused_projections_change_no_token(tiny_qwen35, engine, sampling, switch, monkeypatch):
    """The layer wiring of engine/models/fused_qmm.py (each norm handed to the projection after it,
    each residual add to the projection before it; or the residual adds alone) forced on on the
    CPU, where the builds do not cover the projections and the same ops run unfused: plain decoding
    emits exactly what the default layers emit, fans and random trees match it, and the wiring ran.
    A fresh engine: the setting is part of the layers' compiled traces."""
    from engine.models import fused_qmm

    want = [generate(engine, prompt, sampling).tokens for prompt in PROMPTS]
    calls: list[int] = []
    real = fused_qmm.mlp_residual
    monkeypatch.setattr(getattr(fused_qmm, switch), "enabled", lambda: True)
    monkeypatch.setattr(fused_qmm, "mlp_residual", lambda *a: calls.append(1) or real(*a))
    wired = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16, dtype="float32"))
    assert [generate(wired, prompt, sampling).tokens for prompt in PROMPTS] == want
    assert_fan_and_random_trees_lossless(wired, sampling, "fan")
    assert_fan_and_random_trees_lossless(wired, sampling, "random")
    assert len(calls) >= 4


@pytest.mark.parametrize("penalties", [{}, {"repetition_penalty": 1.3, "frequency_penalty": 0.2}],
                         ids=["plain-draw", "penalties"])
def test_nodes_drawn_at_once_change_no_token(engine, penalties, monkeypatch):
    """A sampled tree's visited nodes chosen on the host at once (engine/cpu_ext.cpp draw_now, the
    CPU's default) or each in a graph of its own (its twin): random trees and fans around plain
    decoding emit plain decoding's tokens either way, penalties on paths that repeat tokens
    included, and the at-once path ran."""
    import mlx.core as mx

    from engine import cpu_ext

    if not cpu_ext.serves(True, mx.zeros((1,))):
        pytest.skip("the engine's CPU operations")
    sampling = dataclasses.replace(SAMPLED, **penalties)
    calls: list[int] = []
    real = cpu_ext.draw_now
    monkeypatch.setattr(cpu_ext, "draw_now", lambda *a: calls.append(1) or real(*a))
    for draw_now in (True, False):
        monkeypatch.setattr(cpu_ext, "DRAW_NOW", draw_now)
        assert_fan_and_random_trees_lossless(engine, sampling, "random")
        assert_fan_and_random_trees_lossless(engine, sampling, "fan")
        assert bool(calls) == draw_now
        calls.clear()


@pytest.mark.parametrize("kind", ["right", "wrong"])
def test_a_verify_row_is_bitwise_the_plain_step(engine, kind, monkeypatch):
    """On the CPU with the engine's products (engine/gemv_shim.c), every verify row whose path is
    plain decoding's own tokens has bitwise the logits of the plain step at its position: the
    output is then plain decoding's by construction, not by a margin. (A one-row product once took
    another kernel than a verify's rows for weights without a half-width copy: logits ~1e-5 apart,
    which flipped a seeded draw of the bundled model after 2k tokens of context.)"""
    import mlx.core as mx

    from engine import blas, forward

    if mx.default_device() != mx.cpu or blas.gemv_calls() is None:
        pytest.skip("batch invariance is the CPU's products' (the GEMV shim preloaded)")
    verify, seen = forward.verify, []

    def recording(model, cache, tree, committed_len, tokens=None):
        logits = verify(model, cache, tree, committed_len, tokens=tokens)
        seen.append((committed_len, tree, logits))
        return logits

    monkeypatch.setattr(forward, "verify", recording)
    spec = SpecConfig(method="none", budget=4, max_depth=4, adaptive=False)
    compared = 0
    for prompt in PROMPTS:
        seen.clear()
        plain = generate(engine, prompt, GREEDY).tokens
        step = {c: np.array(logits[0]) for c, _, logits in seen}
        seen.clear()
        drafter = OracleDrafter(plain, len(prompt), wrong=kind == "wrong")
        assert generate(engine, prompt, GREEDY, spec, drafter).tokens == plain
        for c, tree, logits in seen:
            rows = np.array(logits)
            for node in range(tree.size if kind == "right" else 1):  # the right chain: every node is plain's
                position = c + int(tree.depths[node])
                if position in step:
                    assert np.array_equal(rows[node], step[position]), f"row {node} at {position}"
                    compared += 1
    assert compared > len(PROMPTS) * 20
