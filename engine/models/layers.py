"""Layers shared by the model families: the Batch record of a forward pass, norms, MLP, rotary
embedding, and attention with a KV cache."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx
import mlx.nn as nn

from engine import attention_rows as attention_kernel
from engine import blas, cpu_ext, kv_int8
from engine.cache import KVCache
from engine.cpu_exp import sigmoid, silu, softmax_rows
from engine.gdn.core import TreeInputs
from engine.models import fused_qmm
from engine.models.fused import fuse_into
from engine.models.linear import Linear
from engine.qmm import as_rows

Mode = Literal["chain", "token", "tree"]


@dataclass(frozen=True)
class Batch:
    """How the T new rows of a forward pass relate to the committed state.

    A chain (the default) continues the committed sequence and is written at once (prefill, a
    drafter's own steps). A verify (`deferred`) is a draft tree in topological order, one row for
    plain decoding: every row is computed from the committed state, nothing is written, and each
    layer defers what `commit(path)` needs. For a verify of N > 1 rows, positions [N] int32 are
    absolute (committed_len + depth) and the per-tree inputs are built once and shared by all layers:
    tree_mask [N, N] (ancestors-or-self; every row also sees the whole committed prefix) and the
    GDN tree inputs. eval_every > 0: the model hands the rows to the device every that many
    layers while it builds the rest (engine/forward.py VERIFY_EVAL_EVERY).
    """

    deferred: bool = False
    positions: mx.array | None = None
    tree_mask: mx.array | None = None
    gdn: TreeInputs | None = None
    eval_every: int = 0
    # seen_mask's masks by key count: the attention layers of one verify share them
    seen_masks: dict[int, mx.array] = field(default_factory=dict, compare=False, repr=False)

    def seen_mask(self, keys: int) -> mx.array:
        """[N, keys] True where a tree row sees a key (the committed prefix, then its
        ancestors-or-self among the last N keys), built once for every attention layer of the
        verify: built by each layer it was two more launches a layer, which a GPU's host encodes one
        by one (BENCHMARKS.md, issue 12, twenty-second session)."""
        assert self.tree_mask is not None, "a tree's verify"
        if keys not in self.seen_masks:
            n = self.tree_mask.shape[0]
            self.seen_masks[keys] = mx.concatenate([mx.ones((n, keys - n), dtype=mx.bool_), self.tree_mask], axis=1)
        return self.seen_masks[keys]

    def mode(self, rows: int) -> Mode:
        """What a layer computes: one token (chain step or one-node verify), a tree, or a chain."""
        if rows == 1:
            return "token"
        return "tree" if self.deferred else "chain"


CHAIN = Batch()


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight. Zero-centred HF norms get +1 folded into weight at load time."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return cpu_ext.rms_norm(x, self.weight, self.eps)  # mx.fast.rms_norm but on the CPU


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = Linear(dims, hidden, bias=False)
        self.up_proj = Linear(dims, hidden, bias=False)
        self.down_proj = Linear(hidden, dims, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        # on 2-D rows: a product of [1, T, H] flattens its input and unflattens its output, two
        # graph nodes each that the CPU evaluates at a few µs apiece (the same GEMM either way)
        out = self.down_proj(self.hidden(as_rows(x)))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def hidden(self, rows: mx.array) -> mx.array:
        """silu(gate) * up of rows [M, H] -> [M, hidden]: what down_proj takes."""
        gate, up = self.fused(rows) if "fused" in self else (self.gate_proj(rows), self.up_proj(rows))
        return silu(gate) * up  # engine/cpu_exp.py: the CPU's exp is slow

    def fuse_projections(self) -> bool:
        return fuse_into(self, ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class RopeSpec:
    dims: int  # rotated dims (partial rotary: a prefix of head_dim)
    base: float


def apply_rope(x: mx.array, rope: RopeSpec, offset: int | mx.array, batch: Batch) -> mx.array:
    """x [1, H, T, D]. Chain rows sit at offset + t; verify rows at batch.positions.

    Verify rows are laid out as batch rows so that mx.fast.rope takes one offset per row:
    the same kernel as the chain path, hence the same rounding.
    """
    if cpu_rope(x):
        # one operation of the engine's own (engine/cpu_ext.cpp): a verify row at its position is
        # rotated as the decode step at that position is
        return cpu_ext.rope(x, rope.dims, rope.base, offset, batch.positions)
    if batch.positions is None:
        return _rope(x, rope, offset)
    rows = x.swapaxes(0, 2)  # [T, H, 1, D]
    return _rope(rows, rope, batch.positions).swapaxes(0, 2)


def cpu_products(x: mx.array, modules: list[nn.Module]) -> bool:
    """Whether a norm and the products that read it run as the engine's own CPU operation
    (cpu_ext.norm_products, bitwise the operations' results): the switch on, rows [M, K] float32 on
    the CPU, each module a plain Linear (no bias, not quantized, float32)."""
    return cpu_ext.PRODUCTS and cpu_ext.serves(True, x) and x.ndim == 2 and all(map(_plain_float_linear, modules))


def _plain_float_linear(m: nn.Module) -> bool:
    """A Linear the CPU's operations read the weight of: no bias, not quantized, float32."""
    return type(m) is Linear and "bias" not in m and m["weight"].dtype == mx.float32


def cpu_mlp(mlp: MLP, norm: RMSNorm) -> bool:
    """Whether a layer's MLP block (its residual add, `norm`, the MLP and the add after it) runs as
    the engine's own CPU operation (cpu_ext.mlp_block): the switch on, on the CPU where it is built,
    float32 Linear projections without bias, not fused."""
    if not cpu_ext.MLP or mx.default_device() != mx.cpu or cpu_ext.module() is None or "fused" in mlp:
        return False
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return all(map(_plain_float_linear, projections)) and norm.weight.dtype == mx.float32


def norm_then(flat: mx.array, modules: list[nn.Module], norm: fused_qmm.Norm | None) -> list[mx.array]:
    """[m(norm(flat)) for m in modules]: in one CPU operation where cpu_products says so."""
    if cpu_products(flat, modules):
        return cpu_ext.norm_products(flat, [m["weight"] for m in modules], None if norm is None else norm.weight,
                                     0.0 if norm is None else norm.eps)
    flat = flat if norm is None else norm(flat)
    return [m(flat) for m in modules]


def cpu_rope(x: mx.array) -> bool:
    """Whether RoPE runs as the engine's own CPU operation: on the CPU in float32 where it is built,
    one graph node for MLX's rope's ~15 (compiled) in every attention layer of every step."""
    return cpu_ext.serves(cpu_ext.ROPE, x) and x.ndim == 4


def _rope(x: mx.array, rope: RopeSpec, offset: int | mx.array) -> mx.array:
    """mx.fast.rope; on the CPU compiled, with the offset as an array (one trace per shape)."""
    if mx.default_device() != mx.cpu:
        return mx.fast.rope(x, rope.dims, traditional=False, base=rope.base, scale=1.0, offset=offset)
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return _cpu_rope(rope.dims, rope.base)(x, offset)


@functools.cache
def _cpu_rope(dims: int, base: float) -> Callable[[mx.array, mx.array], mx.array]:
    """MLX's rope, compiled for the CPU: there it is no kernel but ~30 graph nodes built on every
    call (the attention layers call it outside their compiled functions, around the KV cache), which
    a compiled graph fuses to ~15. Bitwise the eager rope's, int or array offset
    (tests/engine/test_attention_ops.py)."""
    return mx.compile(lambda x, offset: mx.fast.rope(x, dims, traditional=False, base=base, scale=1.0,
                                                     offset=offset))


def apply_rope_pair(q: mx.array, k: mx.array, rope: RopeSpec, offset: int | mx.array,
                    batch: Batch) -> tuple[mx.array, mx.array]:
    """apply_rope of q [1, H, T, D] and k [1, Hkv, T, D]. On the CPU MLX's rope is not one kernel
    but ~15 graph nodes even compiled (_cpu_rope), the angles computed anew on every call, so there
    q and k go through one call, stacked on the head axis: each head's arithmetic is the same, so
    are the bits, and a step, a verify or an MTP draft depth saves a dozen nodes an attention layer.
    Elsewhere the rope is one launch each."""
    if mx.default_device() != mx.cpu or cpu_rope(q):  # one launch or one operation each
        return apply_rope(q, rope, offset, batch), apply_rope(k, rope, offset, batch)
    both = apply_rope(mx.concatenate([q, k], axis=1), rope, offset, batch)
    return both[:, : q.shape[1]], both[:, q.shape[1] :]


def attention_ops(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                  mask: mx.array | None = None) -> mx.array:
    """Attention spelled out in ops (softmax in fp32, engine/cpu_exp.py): q [1, H, N, D] over keys/values
    [1, Hkv, L, D], mask [N, L] (True = seen) or None for all."""
    return attention_parts(q, (keys,), (values,), scale, mask)


def attention_parts(q: mx.array, keys: tuple[mx.array, ...], values: tuple[mx.array, ...], scale: float,
                    mask: mx.array | None = None) -> mx.array:
    """attention_ops over the concatenation of K/V sets (a cache buffer and new rows) without
    building it: the parts' scores are joined, not their keys and values. Concatenating copies the
    whole buffer on every call (a DFlash block over 2k context keys on the dev CPU: 4.9 ms a layer
    with the fused kernel over the copy, 3.4 ms this way). keys/values [1, Hkv, Li, D] each, mask
    [N, sum Li]."""
    B, H, N, D = q.shape
    Hkv = keys[0].shape[1]
    G = H // Hkv  # query heads per kv head (GQA); head h reads kv head h // G
    qs = q.reshape(B, Hkv, G * N, D) * scale
    parts = [qs @ k.swapaxes(-1, -2) for k in keys]  # [B, Hkv, G*N, Li]
    scores = (parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)).reshape(B, Hkv, G, N, -1)
    probs = softmax_rows(scores.astype(mx.float32), mask).astype(values[0].dtype).reshape(B, Hkv, G * N, -1)
    if len(values) == 1:
        return (probs @ values[0]).reshape(B, H, N, D)
    outs, start = [], 0
    for v in values:  # each part's probabilities against its own values
        outs.append(probs[..., start : start + v.shape[2]] @ v)
        start += v.shape[2]
    return sum(outs[1:], outs[0]).reshape(B, H, N, D)


# From this many cached keys a one-row step on the CPU attends in ops (see one_row_in_ops); the
# BLAS is fixed at process start (engine/blas.py), before this module loads
FAST_BLAS = blas.fast()
OPS_ATTENTION_FROM = 1024 if FAST_BLAS else 16384


def one_row_in_ops(keys: int) -> bool:
    """Whether a one-row step attends in ops rather than the fused kernel: on the CPU over long
    caches only. MLX's fused CPU kernel reads the keys at a fraction of the bandwidth the two
    BLAS matmuls reach: one query (6 heads, 2 KV heads of 64) over 4,000 / 8,000 / 32k keys took
    1.0-2.1 / 1.5-2.6 / 12-14.5 ms a layer fused against 0.55-0.7 / 1.3-1.7 / 6.5-6.8 in ops on the
    dev CPU with OpenBLAS; decode's median gap between tokens over 2k / 4k keys 1.10x / 1.06x
    shorter (`python scripts/bench_attention.py --runs 6`), at 64 / 1k keys 0.98x (the ops' extra
    launches). A verify's rows attend in ops at every length, so from here on plain decoding and a
    verify round the same way. With the reference BLAS (no preload) ops win only from ~16k keys.
    On a GPU the fused kernel is the one built for it."""
    return keys >= OPS_ATTENTION_FROM and mx.default_device() == mx.cpu


def cpu_rows_attention(q: mx.array, keys: mx.array) -> bool:
    """Whether a decode step's or a verify's rows attend in the engine's own CPU operation
    (engine/cpu_ext.cpp) rather than in MLX's operations: on the CPU in float32 (the keys and
    values float32 or a half cache's), where it is built for the heads' shape. It reads each key and
    value once and takes the softmax in the same pass: one query over 4,000 keys (6 heads, 2 K/V
    heads of 64) 87-162 us a layer against 278-345 in operations, over 64 keys 10-12 against 37-41
    (dev CPU, `python scripts/bench_cpu_attention.py`)."""
    return (cpu_ext.serves(cpu_ext.ATTENTION, q) and keys.dtype in cpu_ext.KV_DTYPES
            and cpu_ext.supports(q.shape[1] // keys.shape[1], q.shape[-1]))


def cpu_causal_attention(q: mx.array, keys: mx.array) -> bool:
    """Whether a prefill chunk's rows attend in the engine's own CPU operation (engine/cpu_ext.cpp
    causal_attention) rather than in MLX's operations or its fused kernel: on the CPU in float32,
    for head dimensions it is built for. 512 rows over 4,000 keys (6 heads, 2 K/V heads of 64)
    took 24-26 ms a layer against 55-70 in operations (dev CPU)."""
    return cpu_ext.serves(cpu_ext.CAUSAL, q, keys) and cpu_ext.supports_causal(q.shape[-1])


def chunk_in_ops(scores: int) -> bool:
    """Whether a chain of rows (a prefill chunk) attends in ops rather than the fused kernel: on
    the CPU with a fast BLAS, where the two GEMMs beat MLX's fused CPU kernel at every length
    measured (512 rows over 512 / 2048 / 4000 keys, 6 heads, 2 K/V heads of 64, fp32, dev CPU:
    14.1 / 89.2 / 164.1 ms against 25.6 / 96.8 / 188.6; a 4000-token prompt's TTFT 2839 against
    3068 ms), while its score matrix (`scores` floats, all heads) stays small: ops materialise it,
    the fused kernel does not."""
    return FAST_BLAS and mx.default_device() == mx.cpu and scores <= CHUNK_OPS_SCORES


CHUNK_OPS_SCORES = 32 << 20  # floats (128 MiB): a 512-row chunk of 6 heads over up to ~10k keys


def causal_mask(rows: int, keys: int) -> mx.array:
    """[rows, keys] True where the key is seen: the rows are the last `rows` positions of `keys`."""
    return mx.arange(keys)[None, :] <= mx.arange(keys - rows, keys)[:, None]


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm and (Qwen3.5) a sigmoid output gate.

    With output_gate, q_proj emits per head [query | gate] (2 * head_dim). The layer runs in three
    phases around the cache: project (pure), attend (writes K/V, reads the cache), output (pure).
    """

    def __init__(self, dims: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 rope: RopeSpec, output_gate: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.output_gate = output_gate
        self.rope = rope
        self.scale = head_dim**-0.5
        self.q_proj = Linear(dims, heads * head_dim * (2 if output_gate else 1), bias=False)
        self.k_proj = Linear(dims, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(dims, kv_heads * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, dims, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project(self, x: mx.array, norm: RMSNorm | None = None) -> list[mx.array]:
        """x [1, T, H] (norm(x) where a norm is given: one launch with the fused projections, by
        engine/models/fused_qmm.py) -> [q, k, v] as [1, heads, T, D] before RoPE (+ gate [1, T, H*D])."""
        B, T, _ = x.shape
        flat = x.reshape(B * T, -1)  # 2-D rows: no flatten and unflatten around each product (MLP)
        if "fused" in self:
            q, k, v = fused_qmm.project(self.fused, flat, norm=norm)
        else:
            q, k, v = norm_then(flat, [self.q_proj, self.k_proj, self.v_proj], norm)
        q = q.reshape(B, T, self.heads, -1)
        if self.output_gate:
            q, gate = mx.split(q, 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, T, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return [q, k, v, gate.reshape(B, T, -1)] if self.output_gate else [q, k, v]

    def fuse_projections(self) -> bool:
        return fuse_into(self, ("q_proj", "k_proj", "v_proj"))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, cache: KVCache, batch: Batch) -> mx.array:
        """RoPE, write the rows to the cache, attend. A chain sees the prefix causally and the cache
        advances; a verify row sees the prefix and its ancestors-or-self, and its rows stay scratch
        until the commit. -> [1, T, heads * D]."""
        T, offset = q.shape[2], cache.offset
        q, k = apply_rope_pair(q, k, self.rope, offset, batch)
        keys, values = cache.write(k, v)
        if not batch.deferred:
            cache.advance(T)
        cpu_rows = (T == 1 or batch.tree_mask is not None) and cpu_rows_attention(q, keys)
        if keys.dtype != q.dtype and not cpu_rows:
            # a half or 8-bit cache (KVCache.dtype) read by a path that takes the queries' type: its
            # rows widened here, a copy of the context; the CPU's rows attention reads them itself
            keys, values = kv_int8.cast_rows(keys, q.dtype), kv_int8.cast_rows(values, q.dtype)
        if (T == 1 or batch.tree_mask is not None) and attention_kernel.SWITCH.enabled() \
                and attention_kernel.covers(q, keys, values) and self.scale == q.shape[-1] ** -0.5:
            # one or two launches instead of four to seven (engine/attention_rows.py; on by default on CUDA)
            out = attention_kernel.attention_rows(q, keys, values, batch.tree_mask)
            return out.reshape(1, T, -1)
        if cpu_rows:
            # one operation of the engine's own instead of eight (engine/cpu_ext.cpp): a decode
            # step and a verify's rows alike, so that a verify row sees what the step would
            prefix = keys.shape[2] - (T if batch.tree_mask is not None else 0)
            out = cpu_ext.rows_attention(q, keys, values, self.scale, prefix, batch.tree_mask)
        elif T > 1 and batch.tree_mask is None and not batch.deferred and cpu_causal_attention(q, keys):
            # a prefill chunk in one operation of the engine's own (engine/cpu_ext.cpp
            # causal_attention): no score array through memory, at any length
            out = cpu_ext.causal_attention(q, keys, values, self.scale)
        elif batch.tree_mask is not None:
            # in ops, not mx.fast.scaled_dot_product_attention with an array mask: on CUDA that
            # routes bf16 to cuDNN, which plans a new graph for every prefix length, about 40 ms a
            # round (measured on the H200)
            out = attention_ops(q, keys, values, self.scale, batch.seen_mask(keys.shape[2]))
        elif T == 1 and one_row_in_ops(keys.shape[2]):
            out = attention_ops(q, keys, values, self.scale)
        elif T > 1 and not batch.deferred and chunk_in_ops(T * keys.shape[2] * self.heads):
            out = attention_ops(q, keys, values, self.scale, causal_mask(T, keys.shape[2]))
        else:
            mask = "causal" if T > 1 and not batch.deferred else None
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(q.shape[0], T, -1)

    def output(self, out: mx.array, gate: mx.array | None, residual: mx.array | None = None) -> mx.array:
        """The output projection (plus residual where given: one launch by engine/models/fused_qmm.py)."""
        out = out * sigmoid(gate) if gate is not None else out
        return self.o_proj(out) if residual is None else fused_qmm.linear_res(self.o_proj, out, residual)
