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

from engine import cpu_ext
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
            # float32 0 / 1, as the CPU's penalize_rows reads it (the operations' logical_or alike)
            mask = np.zeros(vocab, dtype=np.float32)
            ids = np.array([t for t in prompt if 0 <= t < vocab], dtype=np.int64)
            mask[ids] = 1.0
            self.in_prompt = mx.array(mask)
        self.counts = mx.zeros((vocab,), dtype=mx.float32)
        self._neutral: tuple[mx.array, mx.array] | None = None  # kernel_inputs' zeros and penalties
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

    def kernel_inputs(self) -> list[mx.array]:
        """What engine/choose_kernel.py's penalties build reads: counts, bias, in_prompt [V] float32
        (zeros where the request has none: they change no bit there) and the penalties [4] float32
        (frequency, presence, repetition; 0 and 1 where not penalized: no bit either)."""
        if self._neutral is None:
            p = self.params
            zeros = mx.zeros(self.counts.shape, dtype=mx.float32)
            penalized = p.penalized
            pens = mx.array([p.frequency_penalty if penalized else 0.0, p.presence_penalty if penalized else 0.0,
                             p.repetition_penalty if self.repeats else 1.0, 0.0], dtype=mx.float32)
            self._neutral = (zeros, pens)
        zeros, pens = self._neutral
        return [self.counts, zeros if self.bias is None else self.bias,
                zeros if self.in_prompt is None else self.in_prompt, pens]

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

    def _adjust_rows(self, x: mx.array) -> mx.array:
        """_adjust of every row of x [R, V] by the completion's counts: on the CPU one operation of the
        engine's own (engine/cpu_ext.cpp penalize_rows, the same float32 steps: the same bits), else
        MLX's operations."""
        if x.ndim == 2 and cpu_ext.serves(cpu_ext.CHOOSE, x, self.counts):
            p = self.params
            return cpu_ext.penalize_rows(x, self.counts, self.bias, self.in_prompt,
                                         p.frequency_penalty, p.presence_penalty, p.repetition_penalty, p.penalized)
        return self._adjust(x, self.counts[None], self.bias, None if self.in_prompt is None else self.in_prompt[None])

    def path_counts(self, tree: DraftTree, node: int) -> tuple[list[int], list[float]]:
        """The tokens on `node`'s path below the root, each once, and how many times each is there:
        what `apply` counts again for that node's row (its tree's tokens on the host)."""
        counted = Counter(tree.tokens[j] for j in tree.path_to(node)[1:])
        return list(counted), [float(k) for k in counted.values()]

    def apply(self, logits: mx.array, tree: DraftTree | None = None, tokens: mx.array | None = None,
              rows: Sequence[int] | None = None) -> mx.array:
        """logits [R, V] of tree nodes `rows` (default: every node, R = tree.size; a one-node round
        without a tree) -> float32 adjusted logits. `tokens` [1, N]: the tree's tokens where they are
        still on the device (the host's tree then holds placeholders)."""
        x = logits.astype(mx.float32)
        out = self._adjust_rows(x)
        if tree is None or tree.size == 1:
            return out
        nodes = range(tree.size) if rows is None else rows
        paths = [tree.path_to(node)[1:] for node in nodes]
        if tokens is None:  # (row, token, how many times on the row's path), distinct per row
            pairs = [(r, tok, float(k)) for r, path in enumerate(paths)
                     for tok, k in Counter(tree.tokens[j] for j in path).items()]
            if not pairs:
                return out
            rs, cs, ks = zip(*pairs, strict=True)
            cols, extra = mx.array(cs, dtype=mx.int32), mx.array(ks, dtype=mx.float32)
        else:  # the tokens are on the device (a pipelined guess, a chain drafted there): (row, path node)
            nodes_of = [(r, j) for r, path in enumerate(paths) for j in path]
            if not nodes_of:
                return out
            rs, js = zip(*nodes_of, strict=True)
            flat = tokens.reshape(-1).astype(mx.int32)
            cols = flat[mx.array(js, dtype=mx.int32)]
            # each pair's token counted over its row's path, on the device; a token twice on a path
            # gives two pairs with the same value: the scatter below writes it twice
            on_path = np.zeros((len(nodes_of), tree.size), dtype=np.float32)
            for p, r in enumerate(rs):
                on_path[p, list(paths[r])] = 1.0
            extra = ((flat[None] == cols[:, None]) * mx.array(on_path)).sum(axis=-1)
        row_idx = mx.array(rs, dtype=mx.int32)
        counts = self.counts[cols] + extra
        vals = self._adjust(x[row_idx, cols], counts, None if self.bias is None else self.bias[cols],
                            None if self.in_prompt is None else self.in_prompt[cols])
        out[row_idx, cols] = vals  # (row, column) pairs repeat only with equal values
        return out
