"""Token-prefix store of cache snapshots, so repeated prompts skip their prefill.

Recurrent (GDN) and conv states cannot be truncated, so a hybrid model resumes only from a
stored snapshot whose tokens are a prefix of the new prompt; an attention-only model may resume
from any common prefix length (its K/V are just cut). Snapshots are immutable MLX arrays, taken
at the end of a prompt, the end of a generation, and chat-message boundaries (before each
`<|im_start|>`) so that the next turn of a conversation, which re-renders the history, hits.

Bounded by bytes of the arrays actually held; least recently used snapshots go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from engine.cache import KVCache, LayerCache


@dataclass(frozen=True)
class Snapshot:
    tokens: tuple[int, ...]
    layers: tuple[tuple[mx.array, mx.array], ...]  # per layer: (keys, values) or (conv_state, state)
    nbytes: int


def snapshot(cache: list[LayerCache], tokens: tuple[int, ...]) -> Snapshot:
    n = len(tokens)
    layers = []
    for c in cache:
        if isinstance(c, KVCache):
            if c.offset != n:
                raise ValueError(f"KV cache holds {c.offset} tokens, the snapshot key {n}")
            # a copy of the first n rows: the live buffer keeps growing in place
            layers.append((mx.contiguous(c.keys[:, :, :n]), mx.contiguous(c.values[:, :, :n])))
        else:
            layers.append((c.conv_state, c.state))
    mx.eval(layers)
    return Snapshot(tokens, tuple(layers), sum(a.nbytes + b.nbytes for a, b in layers))


def restore(snap: Snapshot, cache: list[LayerCache], length: int) -> None:
    """Load the first `length` tokens of a snapshot into fresh caches (length < len only for
    attention-only models)."""
    for c, (a, b) in zip(cache, snap.layers):
        if isinstance(c, KVCache):
            c.write(a[:, :, :length], b[:, :, :length])
            c.advance(length)
        else:
            c.conv_state, c.state = a, b


class PrefixCache:
    def __init__(self, budget_bytes: int, enabled: bool = True, trimmable: bool = False) -> None:
        self.budget, self.enabled, self.trimmable = budget_bytes, enabled, trimmable
        self.entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self.nbytes = 0

    def lookup(self, prompt: list[int]) -> tuple[Snapshot | None, int]:
        """The best snapshot for a prompt whose tokens [0, len(prompt)) go into the cache:
        -> (snapshot, tokens it covers). Hybrid: a stored key that is a prefix of the prompt;
        attention-only: the longest common prefix with any stored key."""
        best, best_len = None, 0
        if not self.enabled:
            return None, 0
        for key, snap in self.entries.items():
            n = _common_prefix(key, prompt)
            if n < len(key) and not self.trimmable:
                continue
            if n > best_len:
                best, best_len = snap, n
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best, best_len

    def store(self, cache: list[LayerCache], tokens: list[int]) -> None:
        key = tuple(tokens)
        if not self.enabled or not key or key in self.entries:
            if key in self.entries:
                self.entries.move_to_end(key)
            return
        snap = snapshot(cache, key)
        if snap.nbytes > self.budget:
            return
        self.entries[key] = snap
        self.nbytes += snap.nbytes
        while self.nbytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
