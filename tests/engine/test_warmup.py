"""The warm-up `spruce serve` runs on a GPU before taking requests (engine/warmup.py): it covers
every row class and depth class a configured tree can have, and leaves nothing behind that could
change what a request gets."""

from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.forward import LEVEL_STEP, tree_batch, tree_levels
from engine.generate import Engine
from engine.types import GenerationRequest
from engine.warmup import chain_with_siblings, tree_shapes, warm_up


@pytest.mark.parametrize(("budget", "depth"), [(16, 8), (32, 8), (1, 8), (4, 2), (31, 16), (7, 3)])
def test_tree_shapes_cover_every_row_and_level_class(budget, depth):
    """Every tree the engine can verify (root + up to `budget` nodes, depth up to `depth`) falls
    in a row class (ceil(rows / 8)) and a level class (forward.tree_levels) that one of the
    warm-up's trees has."""
    shapes = tree_shapes(budget, depth)
    rows = {math.ceil(n / 8) for n, _ in shapes}
    levels = {tree_levels(d) for _, d in shapes}
    for n in range(2, budget + 2):
        assert math.ceil(n / 8) in rows, n
    for d in range(1, min(depth, budget) + 1):
        assert tree_levels(d) in levels, d
    for n, d in shapes:
        assert 1 <= d <= min(depth, n - 1) and n <= budget + 1
        tree = chain_with_siblings(5, n, d, 1000)
        assert len(tree.tokens) == n and tree.max_depth == d
        assert tree_batch(tree, 10, 4).gdn.levels == tree_levels(d)
        assert tree_levels(d) % LEVEL_STEP == 0 and d + 1 <= tree_levels(d) < d + 1 + LEVEL_STEP


@pytest.mark.parametrize("method", ["ngram", "mtp", "dflash", "none"])
def test_warm_up_leaves_no_trace(method, request):
    """After the warm-up (with each kind of drafter configured: their own passes compile too) the
    prefix cache is empty, no tree cost is remembered (the warm-up's rounds compiled kernels), and
    a request decodes as on a fresh engine."""
    model = request.getfixturevalue("tiny_qwen35_mtp" if method == "mtp" else "tiny_qwen35")
    dflash = str(request.getfixturevalue("tiny_dflash")) if method == "dflash" else None
    spec = SpecConfig(method=method, budget=16, max_depth=8, dflash_model=dflash)
    req = GenerationRequest(prompt_ids=[3, 9, 27, 81, 243, 229, 175, 13, 3, 9, 27],
                            sampling=SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=5))
    cold = Engine(EngineConfig(model_path=str(model), spec=spec))
    want = [t for step in cold.generate(req) for t in step.token_ids]
    warm = Engine(EngineConfig(model_path=str(model), spec=spec))
    report = warm_up(warm)
    assert report.trees == (tuple(tree_shapes(16, 8)) if method != "none" else ()) and report.seconds > 0
    assert warm.prefix.nbytes == 0 and not warm.prefix.entries and not warm.round_costs
    assert [t for step in warm.generate(req) for t in step.token_ids] == want


def test_warm_up_fits_a_small_context(tiny_qwen35):
    """A context of 12 tokens: the warm-up request fits it (the trees run on a scratch cache)."""
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), max_context=12,
                                 spec=SpecConfig(method="ngram", budget=4, max_depth=2)))
    assert warm_up(engine).trees == tuple(tree_shapes(4, 2))


def test_warm_up_takes_the_trees_of_a_given_speculation(tiny_qwen35):
    """A benchmark's engine decodes plainly by default and its requests choose their own
    speculation: the warm-up then covers the trees of the speculation it is given."""
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35)))
    assert warm_up(engine).trees == ()
    assert warm_up(engine, spec=SpecConfig(method="ngram", budget=32, max_depth=6)).trees == tuple(tree_shapes(32, 6))
