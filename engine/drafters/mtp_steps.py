"""The per-depth steps of an MTP draft: `read` a depth's distribution (the target's lm_head -> its
top-k and the argmax), `top1` its argmax alone (a chain drafted on the device), `advance` the head
by one drafted row (the argmax and the row's output).

Two implementations of one protocol, equal up to float rounding (tests/engine/test_mtp_steps.py):
- `PlainDepths`: the head's own forward through its KV cache, writing the drafted rows past the
  committed ones; `close` rewinds them. The obvious one, kept as the twin.
- `CompiledDepths`: `read` and `advance` each one compiled graph. The head's KV cache grows, so
  `advance` runs `MTPHead.draft_row`: the committed K/V buffer is read whole under a length mask and
  the drafted rows go to a fixed-size scratch, so shapes stay fixed and a trace is reused until
  the buffer grows (every KV_STEP rows). On this CPU a head step is mostly per-op overhead and
  weight reads; one graph per step cuts the first.
Neither writes committed state: what `close` leaves is what the catch-up wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from engine.cache import KVCache
from engine.drafters.marginals import top_k_logp
from engine.models.mtp import MTPHead

Logits = Callable[[mx.array], mx.array]  # the target's lm_head: [..., H] -> [..., V]
Embed = Callable[[mx.array], mx.array]  # the target's embedding: ids [1, 1] -> [1, 1, H]


@dataclass(frozen=True)
class DepthRead:
    ids: mx.array  # [k] int32, most likely first
    logp: mx.array  # [k] float32, log-probabilities under the full distribution, descending
    token: mx.array  # [1, 1] the argmax: the next depth's input


def read_depth(logits: Logits, y: mx.array, k: int, vocab: mx.array | None = None
               ) -> tuple[mx.array, mx.array, mx.array]:
    """y [1, 1, H] -> (top-k ids, their log-probabilities, the argmax [1, 1]). Pure (compilable).
    vocab: the token ids of `logits`' columns where they are a draft vocabulary's subset
    (engine/drafters/draft_vocab.py), None where they are the whole vocabulary."""
    row = logits(y)[0, 0]
    ids, logp = top_k_logp(row, k)
    token = mx.argmax(row)
    if vocab is not None:
        ids, token = vocab[ids], vocab[token]
    return ids, logp, token.reshape(1, 1)


def top1(logits: Logits, y: mx.array, vocab: mx.array | None = None) -> mx.array:
    """y [1, 1, H] -> read_depth's argmax [1, 1] alone (a chain drafted on the device needs no
    top-k). Pure (compilable)."""
    token = mx.argmax(logits(y)[0, 0])
    return (token if vocab is None else vocab[token]).reshape(1, 1)


class Depths(Protocol):
    def read(self, y: mx.array) -> DepthRead:
        """The distribution the head's output y [1, 1, H] gives (lazy)."""

    def top1(self, y: mx.array) -> mx.array:
        """`read(y).token` alone (lazy)."""

    def advance(self, token: mx.array, y: mx.array) -> mx.array:
        """The next drafted row: token [1, 1] at the next position, with y as its hidden state
        -> the row's output [1, 1, H] (lazy)."""

    def close(self) -> None:
        """The draft is done: the head's cache holds the committed rows only."""


class PlainDepths:
    def __init__(self, logits: Logits, embed: Embed, head: MTPHead, cache: list[KVCache], k: int,
                 vocab: mx.array | None = None) -> None:
        self.logits, self.embed, self.head, self.cache, self.k, self.vocab = logits, embed, head, cache, k, vocab
        self.marks = [c.mark() for c in cache]

    def read(self, y: mx.array) -> DepthRead:
        return DepthRead(*read_depth(self.logits, y, self.k, self.vocab))

    def top1(self, y: mx.array) -> mx.array:
        return top1(self.logits, y, self.vocab)

    def advance(self, token: mx.array, y: mx.array) -> mx.array:
        return self.head(self.embed(token), y, self.cache)

    def close(self) -> None:
        for c, m in zip(self.cache, self.marks, strict=True):
            c.rewind(m)


class CompiledSteps:
    """The compiled read and advance of one (target, head) pair, kept across a drafter's drafts: a
    trace (a few ms on the CPU) is built per top-k and per KV buffer capacity."""

    def __init__(self, logits: Logits, embed: Embed, head: MTPHead, scratch_rows: int,
                 vocab: mx.array | None = None) -> None:
        self.head, self.scratch_rows = head, max(1, scratch_rows)

        def advance(token: mx.array, y: mx.array, committed: list[tuple[mx.array, mx.array]], length: mx.array,
                    scratch: list[tuple[mx.array, mx.array]], j: mx.array):
            return head.draft_row(embed(token), y, committed, length, scratch, j)

        self.read = mx.compile(lambda y, k: read_depth(logits, y, k, vocab))
        self.top1 = mx.compile(lambda y: top1(logits, y, vocab))
        self.advance = mx.compile(advance)

    def begin(self, cache: list[KVCache], k: int) -> CompiledDepths:
        return CompiledDepths(self, cache, k)


class CompiledDepths:
    def __init__(self, steps: CompiledSteps, cache: list[KVCache], k: int) -> None:
        self.steps, self.k = steps, k
        self.committed = []
        for c in cache:
            assert c.keys is not None and c.values is not None, "the catch-up writes the committed rows first"
            self.committed.append((c.keys, c.values))
        self.length = mx.array(cache[0].offset, dtype=mx.int32)
        self.scratch = [(_rows_like(keys, steps.scratch_rows), _rows_like(values, steps.scratch_rows))
                        for keys, values in self.committed]
        self.j = 0  # the scratch row the next advance writes

    def read(self, y: mx.array) -> DepthRead:
        return DepthRead(*self.steps.read(y, self.k))

    def top1(self, y: mx.array) -> mx.array:
        return self.steps.top1(y)

    def advance(self, token: mx.array, y: mx.array) -> mx.array:
        if self.j == self.steps.scratch_rows:
            raise ValueError(f"a draft of more than {self.steps.scratch_rows} rows past the committed ones")
        j = mx.array(self.j, dtype=mx.int32)
        y, self.scratch = self.steps.advance(token, y, self.committed, self.length, self.scratch, j)
        self.j += 1
        return y

    def close(self) -> None:
        pass


def _rows_like(buffer: mx.array, rows: int) -> mx.array:
    B, H, _, D = buffer.shape
    return mx.zeros((B, H, rows, D), buffer.dtype)
