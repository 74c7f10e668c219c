"""One round of speculation against the target: verify a draft tree in ONE forward pass,
pick the accepted path, and commit only that path into the caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from engine import gdn_tree
from engine.cache import LayerCache, commit_all
from engine.models.layers import TreeBatch
from engine.tree import DraftTree


def tree_batch(tree: DraftTree, committed_len: int, conv_kernel: int = 4) -> TreeBatch:
    positions = mx.array(tree.positions(committed_len).astype(np.int32))
    if tree.size == 1:
        return TreeBatch(parents=tree.parents, positions=positions)
    ancestors = tree.ancestor_mask()
    attn = np.concatenate([np.ones((tree.size, committed_len), dtype=bool), ancestors], axis=1)
    return TreeBatch(parents=tree.parents, positions=positions, attn_mask=mx.array(attn),
                     gdn_masks=gdn_tree.tree_masks(ancestors),
                     conv_taps=mx.array(gdn_tree.tree_conv_taps(tree.parents, conv_kernel)))


def tree_logits(model, cache: list[LayerCache], tree: DraftTree, committed_len: int) -> mx.array:
    """Every tree node through the model in one forward pass -> logits [N, V] (lazy).

    Committed state is read, never written; each layer keeps what its commit needs.
    """
    tokens = mx.array([list(tree.tokens)])
    batch = tree_batch(tree, committed_len, getattr(model.args, "linear_conv_kernel_dim", 4))
    return model(tokens, cache, batch)[0]


def verify(model, cache: list[LayerCache], tree: DraftTree, committed_len: int) -> np.ndarray:
    """tree_logits on the host, float32 [N, V], for the accept walk."""
    return np.array(tree_logits(model, cache, tree, committed_len).astype(mx.float32))


def extend(model, cache: list[LayerCache], ids: list[int], chunk: int = 512) -> None:
    """Append a chain of tokens to the committed state (prefill), `chunk` tokens per forward."""
    for i in range(0, len(ids), chunk):
        h = model.hidden(mx.array([ids[i : i + chunk]]), cache)
        mx.eval(h, [s for c in cache for s in _state_arrays(c)])


def commit(cache: list[LayerCache], path: list[int]) -> None:
    """Fold the accepted rows (node indices root..leaf) into every layer's state."""
    commit_all(cache, list(path))
    mx.eval([s for c in cache for s in _state_arrays(c)])


def _state_arrays(c: LayerCache) -> list[mx.array]:
    arrays = [getattr(c, n, None) for n in ("keys", "values", "conv_state", "state")]
    return [a for a in arrays if a is not None]
