"""The target's forward passes over its caches: extend a chain, verify a tree, commit a path.

- `extend`: append tokens to the committed state (prefill; a drafter catching up), in chunks.
- `verify`: every node of a draft tree in ONE forward pass from the committed state, which is
  read and never written; each layer defers what its commit needs.
- `commit`: keep the accepted path of the last verify in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from engine.cache import AcceptedPath, LayerCache, commit_all
from engine.gdn import ops
from engine.gdn.core import TreeInputs
from engine.kernels import gpu_backend
from engine.models.base import CausalLM
from engine.models.layers import Batch
from engine.tree import DraftTree

# A verify of more than one node is handed to a GPU every this many layers while the host builds
# the rest of its graph: a round waits for its verify before the next can be drafted, so the
# host's graph building (2.3 ms of a 17-node 9B-shaped verify, H200) is not hidden behind device
# work the way a plain decode step's is, and without this the device idles through it. 0: once,
# at the end. Measured on CUDA only (BENCHMARKS.md, issue 10); the CPU, where MLX evaluates on the
# host's own cores, did not gain from it, and on Metal it is unmeasured, so both leave it off.
VERIFY_EVAL_EVERY = 2

# ... where a layer's device work outlasts what a hand-over costs the host (each mid-build
# evaluation call encodes and hands over what is built so far): on a model whose layers hold less
# than this many bytes of weights the verify is handed over once. The bundled target (5.7 MiB a
# layer in fp32) on the H200, profiled round by round (scripts/profile_rounds.py, variants
# interleaved, DFlash and MTP DDTree@16 on four prompts): the verify's graph building took 2.7-3.7
# ms handed over every 2 layers against 0.8-1.1 ms once, and the round 0.2-0.7 ms longer in 7 of 8
# pairs; the 9B shape (~140 MiB a layer) gains from every 2 (BENCHMARKS.md, issue 10, ninth
# session). Shapes in between (the 0.8B's ~11 MiB) keep every 2: their one measurement was on an
# erratic lease (BENCHMARKS.md, issue 12, sixteenth session).
VERIFY_EVAL_MIN_LAYER_BYTES = 8 << 20


# The GDN tree kernel keeps a stack of states on chip, one level a depth (metal/gdn_tree.kernel),
# and its compiled variants and the layers' traced functions are per level count: trees are put in
# classes of LEVEL_STEP levels. Powers of two made a depth-8 tree (the default's deepest) a class of
# 16 levels: 32 KiB of shared memory a block of four state rows on the 9B shape, six blocks an H200
# SM, so its 4096 rows ran in two waves; 12 levels fit nine blocks and one wave. Under ncu, 17
# nodes, a 9B layer: 28.2 -> 20.2 us, with the last commit folded in 39.0 -> 24.3 us.
LEVEL_STEP = 4


def tree_levels(max_depth: int) -> int:
    """The level class of a tree of depth `max_depth`: its levels (depth + 1) rounded up to a
    multiple of LEVEL_STEP."""
    return -(-(max_depth + 1) // LEVEL_STEP) * LEVEL_STEP


def tree_batch(tree: DraftTree, committed_len: int, conv_kernel: int, eval_every: int = 0) -> Batch:
    """The verify Batch of a tree whose root sits at position committed_len (eval_every: see
    verify_eval_every).

    Every host-to-device copy costs (about 0.1 ms each on the H200 machine, where building this
    Batch from eight arrays took 0.5 ms of a 17-node verify): the integer inputs travel as one
    array sliced on the device, the ancestor mask as a second, and the dense form's masks are
    derived from it lazily (never computed where the kernels do not read them)."""
    if tree.size == 1:  # the root sits where the caches end: no positions, no masks to send
        return Batch(deferred=True)
    n = tree.size
    taps = ops.tree_conv_taps(tree.parents, conv_kernel)
    ints = mx.array(np.concatenate([tree.positions(committed_len), tree.dfs_order, tree.depths, taps.reshape(-1)]))
    ancestors = mx.array(tree.ancestor_mask())
    levels = tree_levels(tree.max_depth)
    gdn = TreeInputs(ints[3 * n :].reshape(n, conv_kernel), ops.device_tree_masks(ancestors), ints[n : 2 * n],
                     ints[2 * n : 3 * n], levels)
    return Batch(deferred=True, positions=ints[:n], tree_mask=ancestors, gdn=gdn, eval_every=eval_every)


def verify_eval_every(model: CausalLM) -> int:
    """Batch.eval_every of a multi-node verify of `model`: VERIFY_EVAL_EVERY on CUDA where its
    layers are large enough (VERIFY_EVAL_MIN_LAYER_BYTES), 0 elsewhere."""
    if gpu_backend() != "cuda":
        return 0
    return VERIFY_EVAL_EVERY if layer_nbytes(model) >= VERIFY_EVAL_MIN_LAYER_BYTES else 0


def layer_nbytes(model: CausalLM) -> int:
    """The mean bytes of weights of one decoder layer (`*.layers.<i>.*` parameters), computed once
    a model and kept on it."""
    cached = getattr(model, "spruce_layer_nbytes", None)
    if cached is None:
        sizes: dict[str, int] = {}
        params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[attr-defined,assignment]
        for name, value in params:
            parts = name.split(".")
            if "layers" in parts[:-1]:
                at = parts.index("layers")
                layer = ".".join(parts[: at + 2])
                sizes[layer] = sizes.get(layer, 0) + value.nbytes
        cached = sum(sizes.values()) // max(1, len(sizes))
        object.__setattr__(model, "spruce_layer_nbytes", cached)
    return int(cached)


def verify(model: CausalLM, cache: list[LayerCache], tree: DraftTree, committed_len: int,
           tokens: mx.array | None = None) -> mx.array:
    """Logits [N, V] of every tree node (lazy). tokens: the tree's tokens as a device array
    [1, N], when they are not on the host yet (a pipelined root)."""
    if tokens is None:
        tokens = mx.array([list(tree.tokens)])
    eval_every = verify_eval_every(model) if tree.size > 1 else 0  # a one-node round is handed over whole
    batch = tree_batch(tree, committed_len, model.args.linear_conv_kernel_dim, eval_every)
    return model(tokens, cache, batch).squeeze(0)


def extend(model: CausalLM, cache: list[LayerCache], ids: Sequence[int], chunk: int = 512) -> None:
    """Append a chain of tokens to the committed state, `chunk` tokens per forward pass.

    Only the caches are evaluated, not the pass's output: nothing reads it, and MLX then skips
    what only the output needs, the last layer's attention output (or GDN output), MLP and the
    final norm over every row (unless a FeatureCache records the final state). Bundled target,
    2048-token prompt on the dev CPU: 1347 ms against 1667 ms, the caches bit for bit the same."""
    for i in range(0, len(ids), chunk):
        model.hidden(mx.array([list(ids[i : i + chunk])]), cache)
        mx.eval(state_arrays(cache))


def commit(cache: list[LayerCache], path: Sequence[int], evaluate: bool = True) -> None:
    """Fold the accepted rows (node indices root..leaf) into every layer. evaluate=False leaves
    the new state lazy (a pipelined round queues it with the next verify)."""
    commit_all(cache, AcceptedPath(tuple(path)))
    if evaluate:
        mx.eval(state_arrays(cache))


def state_arrays(cache: list[LayerCache]) -> list[mx.array]:
    return [a for c in cache for a in c.arrays()]
