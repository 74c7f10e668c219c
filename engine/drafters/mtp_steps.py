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

On the CPU a whole chain draft can also run as one operation of the engine's own (`CpuChain`,
engine/cpu_ext.cpp mtp_chain): the same depths, reads and stop rule as MTPDrafter's loop over these
steps, which is its twin (tests/engine/test_mtp_chain.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import cpu_ext
from engine.cache import KVCache
from engine.drafters.draft_vocab import DenseRows, output_projection
from engine.drafters.marginals import top_k_logp
from engine.models.base import CausalLM
from engine.models.linear import Linear
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


class CpuChain:
    """Every depth of an MTP chain draft in one CPU operation (engine/cpu_ext.cpp mtp_chain).

    Depth by depth (MTPDrafter._draft over CompiledDepths) a depth is ~95 graph nodes and a sync
    for the stop rule: ~0.29 ms on the dev CPU, of which the products are about a third. Here the
    head's rows, the reads (top-k, log-probabilities, argmax) and the stop rule run in one
    operation over the same weights (its products through the same BLAS call as MLX's, so the
    GEMV shim's kernel where a weight has a bfloat16 copy). `build` says None where the head is not
    the plain one this covers (one decoder layer with an output gate, float32 Linear weights without
    bias, a float32 embedding and lm_head) or the operation is not built: the loop runs then."""

    def __init__(self, head: MTPHead, embed: mx.array, lm: mx.array, vocab_ids: mx.array | None) -> None:
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        self.embed, self.lm, self.vocab_ids = embed, lm, vocab_ids
        self.weights = [head.pre_fc_norm_embedding.weight, head.pre_fc_norm_hidden.weight, head.fc.weight,
                        layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                        attn.q_norm.weight, attn.k_norm.weight, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                        mlp.down_proj.weight, head.norm.weight]
        self.heads, self.head_dim, self.rope_dims = attn.heads, attn.head_dim, attn.rope.dims
        self.rope_base, self.eps, self.scale = float(attn.rope.base), float(head.norm.eps), float(attn.scale)

    @classmethod
    def build(cls, target: CausalLM, head: MTPHead, logits: Logits, vocab_ids: mx.array | None) -> CpuChain | None:
        if mx.default_device() != mx.cpu or cpu_ext.module() is None or len(head.layers) != 1:
            return None
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        linears = [head.fc, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj]
        if "fused" in attn or "fused" in mlp or not attn.output_gate or not cpu_ext.supports(
                attn.heads // attn.kv_heads, attn.head_dim) or any(type(m) is not Linear or "bias" in m
                                                                   for m in linears):
            return None
        embed = _plain_weight(target.model.embed_tokens)  # type: ignore[attr-defined]
        if isinstance(logits, DenseRows):  # a draft vocabulary's gathered rows
            lm = logits.weight if logits.bias is None else None
        else:
            lm = _plain_weight(output_projection(target)) if vocab_ids is None else None
        chain = None if embed is None or lm is None else cls(head, embed, lm, vocab_ids)
        if chain is None or any(w.dtype != mx.float32 for w in chain.weights):
            return None
        return chain

    def draft(self, y: mx.array, cache: KVCache, depth: int, k: int, log_min_path: float,
              also: list[mx.array], draws: cpu_ext.ChainDraws | None = None) -> tuple[np.ndarray, np.ndarray]:
        """From the head's output y [1, 1, H] of the last committed row: (ids [D, k], logp [D, k]) of
        depths 1..D, D <= depth as the stop rule leaves it; `also` evaluated with it (the catch-up's
        rows)."""
        assert cache.keys is not None and cache.values is not None, "the catch-up writes the committed rows first"
        ids, logp, reached = self._run(y, cache, depth, k, log_min_path, None, draws)
        mx.eval(ids, logp, reached, also)
        return self._kept(ids, logp, reached)

    def draft_after(self, tokens: mx.array, hidden: mx.array, cache: KVCache, depth: int, k: int,
                    log_min_path: float,
                    draws: cpu_ext.ChainDraws | None = None) -> tuple[np.ndarray, np.ndarray, mx.array]:
        """The head's catch-up of T committed positions (tokens int32 [T]: each position's next token;
        hidden [T, H]: the target's final-normed states), written into `cache` as MTPHead.append
        writes it, then the draft from its last row -> (ids, logp as `draft`, that row's output
        [1, 1, H])."""
        assert cache.keys is not None and cache.values is not None, "the prompt's rows come first (begin)"
        ids, logp, reached, keys, values, y = self._run(hidden[-1], cache, depth, k, log_min_path, (tokens, hidden),
                                                        draws)
        cache.write(keys, values)
        cache.advance(tokens.shape[0])
        mx.eval(ids, logp, reached, y, cache.arrays())
        return (*self._kept(ids, logp, reached), y)

    def guess_after(self, tokens: mx.array, hidden: mx.array, cache: KVCache,
                    draws: cpu_ext.ChainDraws | None = None) -> tuple[mx.array, mx.array]:
        """draft_after's catch-up and its first depth's argmax alone, all lazy (nothing is evaluated:
        the tokens may still be on their way) -> (the token [1, 1] int32, the last row's output)."""
        ids, _, _, keys, values, y = self._run(hidden[-1], cache, 1, 1, -math.inf, (tokens, hidden), draws)
        cache.write(keys, values)
        cache.advance(tokens.shape[0])
        return ids, y

    def _run(self, y: mx.array, cache: KVCache, depth: int, k: int, log_min_path: float,
             rows: tuple[mx.array, mx.array] | None,
             draws: cpu_ext.ChainDraws | None = None) -> tuple[mx.array, ...]:
        assert cache.keys is not None and cache.values is not None
        return cpu_ext.mtp_chain(
            y, self.embed, self.lm, self.vocab_ids, self.weights, cache.keys, cache.values, cache.offset,
            heads=self.heads, head_dim=self.head_dim, rope_dims=self.rope_dims, rope_base=self.rope_base,
            eps=self.eps, scale=self.scale, k=min(k, self.lm.shape[0]), depth=depth,
            log_min_path=log_min_path, rows=rows, draws=draws)

    @staticmethod
    def _kept(ids: mx.array, logp: mx.array, reached: mx.array) -> tuple[np.ndarray, np.ndarray]:
        n = int(np.array(reached)[0])
        return np.array(ids)[:n], np.array(logp)[:n]


def _plain_weight(module: nn.Module) -> mx.array | None:
    """A float32 Embedding's or Linear's weight, where it is a plain one (no quantization, bias or
    rotation): what mtp_chain reads rows of."""
    if type(module) not in (nn.Embedding, Linear, nn.Linear) or "weight" not in module or "bias" in module \
            or "scales" in module:
        return None
    weight: mx.array = module["weight"]
    return weight if weight.dtype == mx.float32 and weight.ndim == 2 else None
