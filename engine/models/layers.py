"""Layers shared by the model families: norms, MLP, rotary embedding, attention with a KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from engine.cache import KVCache
from engine.gdn_tree import TreeMasks


@dataclass
class TreeBatch:
    """Rows of one verify pass: a draft tree laid out in topological order.

    positions [N] int32 are absolute (committed_len + depth). For N > 1 the per-tree masks are
    built once here and shared by all layers: attn_mask [N, committed_len + N] (the prefix and
    ancestors-or-self), gdn_masks for the dense GDN form, conv_taps [N, K] for the tree conv.
    With N == 1 the single row sees the whole prefix and itself: no masks.
    """

    parents: tuple[int, ...]
    positions: mx.array
    attn_mask: mx.array | None = None
    gdn_masks: TreeMasks | None = None
    conv_taps: mx.array | None = None


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight. Zero-centred HF norms get +1 folded into weight at load time."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RopeSpec:
    dims: int  # rotated dims (partial rotary: a prefix of head_dim)
    base: float


def apply_rope(x: mx.array, rope: RopeSpec, offset: int, tree: TreeBatch | None) -> mx.array:
    """x [1, H, T, D]. Chain rows sit at offset + t; tree rows at tree.positions.

    Tree rows are laid out as batch rows so that mx.fast.rope takes one offset per row:
    the same kernel as the chain path, hence the same rounding.
    """
    if tree is None:
        return mx.fast.rope(x, rope.dims, traditional=False, base=rope.base, scale=1.0, offset=offset)
    rows = x.swapaxes(0, 2)  # [T, H, 1, D]
    rows = mx.fast.rope(rows, rope.dims, traditional=False, base=rope.base, scale=1.0, offset=tree.positions)
    return rows.swapaxes(0, 2)


def attend(q: mx.array, k: mx.array, v: mx.array, cache: KVCache, scale: float, tree: TreeBatch | None) -> mx.array:
    """q, k, v [1, H*, T, D] (RoPE applied). Writes k, v to the cache and attends.

    Chain: causal over prefix + new rows, and the cache advances. Tree: each row sees the
    committed prefix and its ancestors-or-self; the cache keeps the rows as scratch until commit.
    """
    T = q.shape[2]
    keys, values = cache.write(k, v)
    if tree is None:
        mask = "causal" if T > 1 else None
        cache.advance(T)
    else:
        mask = tree.attn_mask
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm and (Qwen3.5) a sigmoid output gate.

    With output_gate, q_proj emits per head [query | gate] (2 * head_dim).
    """

    def __init__(self, dims: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 rope: RopeSpec, output_gate: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.output_gate = output_gate
        self.rope = rope
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dims, heads * head_dim * (2 if output_gate else 1), bias=False)
        self.k_proj = nn.Linear(dims, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dims, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dims, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project(self, x: mx.array) -> list[mx.array]:
        """x [1, T, H] -> [q, k, v] as [1, heads, T, D] before RoPE (+ gate [1, T, H*D])."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.heads, -1)
        if self.output_gate:
            q, gate = mx.split(q, 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return [q, k, v, gate.reshape(B, T, -1)] if self.output_gate else [q, k, v]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache, tree: TreeBatch | None) -> mx.array:
        offset = cache.offset
        q = apply_rope(q, self.rope, offset, tree)
        k = apply_rope(k, self.rope, offset, tree)
        out = attend(q, k, v, cache, self.scale, tree)
        return out.transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[2], -1)

    def output(self, out: mx.array, gate: mx.array | None) -> mx.array:
        return self.o_proj(out * mx.sigmoid(gate) if self.output_gate else out)

    def __call__(self, x: mx.array, cache: KVCache, tree: TreeBatch | None) -> mx.array:
        q, k, v, *gate = self.project(x)
        return self.output(self.attend(q, k, v, cache, tree), gate[0] if gate else None)
