"""Run once what the first requests would otherwise compile, before a server takes them.

On a GPU, MLX compiles its kernels and the engine's (NVRTC on CUDA) the first time each variant
runs in a process. Measured on the H200 (9B shape, 4-bit): the first decode of a process took
~95 s; in a warm process the first verify of a tree of 9 rows took 3.9 s (a new row class of the
small-M matmul, whose template takes ceil(rows / 8)) while other new sizes cost ~13 ms once. A
server that compiles during its first requests stalls them, so `spruce serve` calls `warm_up` on
GPU backends after loading: a short request through the real path (prefill, decode, the configured
drafter's rounds), then two verifies + commits of a tree (the second with the first's commit
folded in) for each row class and each level class of the GDN tree kernel (forward.tree_levels)
that the configured budget and depth can produce, on a scratch cache. Nothing it does stays: the
prefix cache is emptied after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from engine import forward
from engine.config import SamplingParams, SpecConfig
from engine.tree import DraftTree
from engine.types import GenerationRequest

if TYPE_CHECKING:
    from engine.generate import Engine

ROW_CLASS = 8  # rows per tile of the small-M matmul (metal/qmm_mma.kernel: NT = ceil(rows / 8))


@dataclass(frozen=True)
class WarmupReport:
    seconds: float
    trees: tuple[tuple[int, int], ...]  # (nodes, depth) of each tree verified


def tree_shapes(budget: int, max_depth: int) -> list[tuple[int, int]]:
    """(nodes, depth) of the trees to verify: a chain for each of the kernel's level classes (the
    deepest the budget and depth allow in it) and, at full depth, one tree per row class up to
    budget + 1 nodes (the root too)."""
    nodes_max = budget + 1
    deepest: dict[int, int] = {}
    for depth in range(1, min(max_depth, nodes_max - 1) + 1):
        deepest[forward.tree_levels(depth)] = depth
    shapes: list[tuple[int, int]] = [(depth + 1, depth) for depth in deepest.values()]
    for tiles in range(1, -(-nodes_max // ROW_CLASS) + 1):
        nodes = min(tiles * ROW_CLASS, nodes_max)  # ceil(nodes / 8) == tiles
        shape = (nodes, min(max_depth, nodes - 1))
        if nodes > 1 and shape not in shapes:
            shapes.append(shape)
    return shapes


def chain_with_siblings(root: int, nodes: int, depth: int, vocab: int) -> DraftTree:
    """A chain of `depth` nodes under the root, the other nodes siblings along it; every node
    another token (siblings must differ)."""
    parents = [-1, *range(depth)]
    parents += [i % depth for i in range(nodes - 1 - depth)]
    return DraftTree(tuple([root] + [(root + 1 + i) % vocab for i in range(nodes - 1)]), tuple(parents))


def warm_up(engine: Engine, new_tokens: int = 8, spec: SpecConfig | None = None) -> WarmupReport:
    """The warm-up, sized to fit the engine's context (a prompt of up to 24 ids, `new_tokens`
    tokens after it, trees up to the speculation budget after the prompt). `spec`: the speculation
    whose trees to warm (default: the engine's; a benchmark whose requests choose their own)."""
    t0 = time.perf_counter()
    vocab, context = engine.vocab_size, engine.config.max_context
    spec = spec or engine.config.spec
    new_tokens = max(1, min(new_tokens, context // 4))
    ids = [(17 * i + 3) % vocab for i in range(max(2, min(24, context - new_tokens - 1)))]
    req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    for _ in engine.generate(req):
        pass
    shapes = tree_shapes(spec.budget, spec.max_depth) if spec.method != "none" else []
    model = engine.model
    cache = engine.make_cache()
    forward.extend(model, cache, ids[:-1], engine.prefill_chunk)
    committed = len(ids) - 1
    for nodes, depth in shapes:
        marks = [c.mark() for c in cache]
        tree = chain_with_siblings(ids[-1], nodes, depth, vocab)
        # twice: where commits fold into the next verify (GDNCache), the second verify is that
        # build of the kernels, and a round after another runs it
        for position in (committed, committed + depth + 1):
            mx.eval(forward.verify(model, cache, tree, position))
            forward.commit(cache, tree.path_to(depth))
        for c, m in zip(cache, marks, strict=True):
            c.rewind(m)
    engine.prefix.clear()
    # the warm-up's rounds compiled kernels: their times are not what trees cost (engine/spec_control.py)
    engine.round_costs.clear()
    return WarmupReport(time.perf_counter() - t0, tuple(shapes))
