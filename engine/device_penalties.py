"""A request's logit bias and penalties applied on the device, so that its tokens are chosen there
(engine/device_sampler.py) instead of copying every round's [N, vocab] logits to the host.

The host's `adjust_logits` (engine/logits_extras.py, float64 NumPy) is the definition and the twin:
logits + bias - frequency_penalty * count - presence_penalty * [count > 0], then the repetition
penalty (x / p where x > 0, else x * p) on every token of the prompt or generated so far. The
counts of a tree node are those of the completion so far plus the tokens on its path below the
root, as plain decoding would have them after the same tokens.

The completion's counts live on the device and grow as tokens are emitted, in the order they are
decided: a plain round's token right where it is chosen (still on the device, so the round queued
behind it sees it), a tree's accepted tokens when it lands. A node's own path tokens are a few
(node, token) pairs: every row is adjusted from the completion's counts, then those pairs are
recomputed with their extra counts, so a row costs the same elementwise pass whatever the tree.

Measured on the H200 (bundled target, fp32, sampling with its generation_config.json, whose
repetition penalty 1.1 sent every request to the host): plain decoding 356-386 tok/s on the host
path against 537-768 tok/s for the same sampling without the penalty on the device (BENCHMARKS.md,
issue 10, fifteenth session).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from engine.config import SamplingParams
from engine.tree import DraftTree


class DevicePenalties:
    """One request's adjustment state (SamplingParams.reweights): bias [V], counts of generated
    tokens [V], prompt tokens [V]."""

    def __init__(self, params: SamplingParams, vocab: int, prompt: Sequence[int], generated: Sequence[int]) -> None:
        self.params = params
        self.bias: mx.array | None = None
        if params.logit_bias:
            bias = np.zeros(vocab, dtype=np.float32)
            for tok, b in params.logit_bias:
                if 0 <= tok < vocab:
                    bias[tok] += b
            self.bias = mx.array(bias)
        self.repeats = params.repetition_penalty != 1.0
        self.in_prompt: mx.array | None = None
        if self.repeats:
            mask = np.zeros(vocab, dtype=bool)
            ids = np.array([t for t in prompt if 0 <= t < vocab], dtype=np.int64)
            mask[ids] = True
            self.in_prompt = mx.array(mask)
        self.counts = mx.zeros((vocab,), dtype=mx.float32)
        if generated:
            self.add(list(generated))

    def add(self, tokens: Sequence[int] | mx.array) -> None:
        """Tokens emitted (host ids, or ids still on the device), in order."""
        if isinstance(tokens, mx.array):
            idx = tokens.reshape(-1).astype(mx.int32)
        else:
            if not tokens:
                return
            idx = mx.array(list(tokens), dtype=mx.int32)
        self.counts = self.counts.at[idx].add(1.0)

    def _adjust(self, x: mx.array, counts: mx.array, bias: mx.array | None, in_prompt: mx.array | None) -> mx.array:
        """The host's adjust_logits elementwise in float32; counts / bias / in_prompt broadcast to x."""
        p = self.params
        if bias is not None:
            x = x + bias
        if p.penalized:
            x = x - (p.frequency_penalty * counts + mx.where(counts > 0, p.presence_penalty, 0.0))
        if self.repeats:
            assert in_prompt is not None
            seen = mx.logical_or(in_prompt, counts > 0)
            x = mx.where(seen, mx.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        return x

    def apply(self, logits: mx.array, tree: DraftTree | None = None, tokens: mx.array | None = None,
              rows: Sequence[int] | None = None) -> mx.array:
        """logits [R, V] of tree nodes `rows` (default: every node, R = tree.size; a one-node round
        without a tree) -> float32 adjusted logits. `tokens` [1, N]: the tree's tokens where they are
        still on the device (the host's tree then holds placeholders)."""
        x = logits.astype(mx.float32)
        out = self._adjust(x, self.counts[None], self.bias, None if self.in_prompt is None else self.in_prompt[None])
        if tree is None or tree.size == 1:
            return out
        nodes = range(tree.size) if rows is None else rows
        # (row, its path's token or the node holding it on the device, how many times on the path)
        pairs: list[tuple[int, int, float]] = []
        for r, node in enumerate(nodes):
            path = tree.path_to(node)[1:]
            if tokens is None:
                pairs += [(r, tok, float(k)) for tok, k in Counter(tree.tokens[j] for j in path).items()]
            else:  # device tokens: the one-guess tree, a path of at most one token below the root
                assert len(path) <= 1, "a tree's tokens are on the device only for the one-guess tree"
                pairs += [(r, j, 1.0) for j in path]
        if not pairs:
            return out
        rs, cs, ks = zip(*pairs, strict=True)
        row_idx = mx.array(rs, dtype=mx.int32)
        cols = mx.array(cs, dtype=mx.int32)
        if tokens is not None:
            cols = tokens.reshape(-1)[cols].astype(mx.int32)
        counts = self.counts[cols] + mx.array(ks, dtype=mx.float32)
        vals = self._adjust(x[row_idx, cols], counts, None if self.bias is None else self.bias[cols],
                            None if self.in_prompt is None else self.in_prompt[cols])
        out[row_idx, cols] = vals  # the pairs are distinct: a plain scatter
        return out
