"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.6 checkpoints (`mtp.*` tensors).

For the token x_{i+1} and the target's final-normed hidden state h_i of position i:

    x = fc([pre_fc_norm_embedding(embed(x_{i+1})); pre_fc_norm_hidden(h_i)])
    x = one full-attention decoder layer (the target's attention layer shape, own KV cache), at position i
    y = norm(x)  ->  the target's lm_head gives the distribution of x_{i+2}

and y stands in for h_{i+1} when drafting further (vLLM's and SGLang's recursion). The embedding
and lm_head are the target's. HF stores every MTP norm zero-centred (applied as 1 + w), like the
target's own; `sanitize` adds the 1.

Two ways to run it: `__call__` through the head's KV cache (rows of committed positions, a chain or
one token), and `draft_row`, one drafted row whose shapes do not depend on how many rows are
committed, so that a drafter can compile its per-depth step once (engine/drafters/mtp_steps.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from engine import attention_rows as attention_kernel
from engine import cpu_ext
from engine.cache import KVCache
from engine.cpu_exp import softmax_rows
from engine.gdn.core import OpsCore
from engine.models.base import ModelArgs
from engine.models.layers import CHAIN, Batch, RMSNorm, apply_rope, apply_rope_pair
from engine.models.linear import Linear
from engine.models.qwen3_5 import DecoderLayer

# every RMSNorm of the head: its own three and the decoder layer's four
ZERO_CENTRED = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs, layers: int = 1) -> None:
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.fc = Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, eps)
        self.pre_fc_norm_hidden = RMSNorm(H, eps)
        # attention layers never call their GDN core: any core will do
        self.layers = [DecoderLayer(args, True, OpsCore()) for _ in range(layers)]
        self.norm = RMSNorm(H, eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def fuse_projections(self) -> int:
        """Fuse each layer's same-input projections, as the target's (engine/models/fused.py): a
        drafted depth is a chain of small launches, and on a GPU each costs the host its encoding
        -> how many groups were fused."""
        return sum(int(layer.self_attn.fuse_projections()) + int(layer.mlp.fuse_projections())
                   for layer in self.layers)

    def __call__(self, embedded: mx.array, hidden: mx.array, cache: list[KVCache],
                 batch: Batch = CHAIN) -> mx.array:
        """embedded, hidden [1, T, H] of consecutive positions from cache.offset -> y [1, T, H]."""
        x = self.fc_in(embedded, hidden)
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, c, batch)
        return self.norm(x)

    def append(self, embedded: mx.array, hidden: mx.array, cache: list[KVCache]) -> mx.array:
        """Committed rows [1, T, H] into the caches (a catch-up) -> y [1, 1, H] of the last row only.
        Nothing reads the last layer's outputs of the other rows, only their K/V, so its attention
        and MLP run for one row: a 2048-row prompt's catch-up cost 110 ms more on the dev CPU when
        the whole layer ran for every row. Equals __call__ (its last row) up to rounding."""
        x = self.fc_in(embedded, hidden)
        *inner, last = self.layers
        for layer, c in zip(inner, cache[:-1], strict=True):
            x = layer(x, c, CHAIN)
        if x.shape[1] > 1:  # the K/V of all rows but the last, as the layer's attend writes them
            attn, c = last.self_attn, cache[-1]
            _, k, v, *_ = attn.project(last.input_layernorm(x[:, :-1]))
            c.write(apply_rope(k, attn.rope, c.offset, CHAIN), v)
            c.advance(x.shape[1] - 1)
        return self.norm(last(x[:, -1:], cache[-1], CHAIN))

    def fc_in(self, embedded: mx.array, hidden: mx.array) -> mx.array:
        return self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)],
                                      axis=-1))

    def draft_row(self, embedded: mx.array, hidden: mx.array, committed: Sequence[tuple[mx.array, mx.array]],
                  length: mx.array, scratch: Sequence[tuple[mx.array, mx.array]],
                  j: mx.array) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        """One drafted row at position length + j; pure and shape-stable (compilable). embedded, hidden
        [1, 1, H]; per layer: committed K/V buffers [1, Hkv, cap, D] (a KVCache's, read whole: rows
        [0, length) count), scratch K/V [1, Hkv, S, D] (rows [0, j) are the draft's earlier rows).
        Equals __call__ through a cache whose rows past `length` are the scratch's.
        -> (y [1, 1, H], the scratch with this row's K/V written at row j)."""
        x, written = self.fc_in(embedded, hidden), []
        for layer, (keys, values), (skeys, svalues) in zip(self.layers, committed, scratch, strict=True):
            attn = layer.self_attn
            q, k, v, *gate = attn.project(layer.input_layernorm(x))
            q, k = apply_rope_pair(q, k, attn.rope, length + j, CHAIN)
            skeys = mx.slice_update(skeys, k, j.reshape(1), axes=(2,))
            svalues = mx.slice_update(svalues, v, j.reshape(1), axes=(2,))
            out = scratch_attention(q, keys, values, length, skeys, svalues, j, attn.scale)
            h = x + attn.output(out, gate[0] if gate else None)
            x = h + layer.mlp(layer.post_attention_layernorm(h))
            written.append((skeys, svalues))
        return self.norm(x), written

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names without the `mtp.` prefix; every RMSNorm weight gets the +1 of HF's zero-centred norms."""
        return {k: (v.astype(mx.float32) + 1.0 if k.endswith(ZERO_CENTRED) and v.ndim == 1 else v)
                for k, v in weights.items()}


def scratch_attention(q: mx.array, keys: mx.array, values: mx.array, length: mx.array, skeys: mx.array,
                      svalues: mx.array, j: mx.array, scale: float) -> mx.array:
    """One query row q [1, H, 1, D] over rows [0, length) of keys/values [1, Hkv, cap, D] and rows
    [0, j] of the scratch [1, Hkv, S, D], one softmax (fp32) over both -> [1, 1, H * D]. Masking the
    whole buffer instead of slicing it keeps the shapes independent of `length`."""
    B, H, _, D = q.shape
    if (attention_kernel.DRAFT_SWITCH.enabled() and scale == D**-0.5
            and attention_kernel.covers(q, keys, values) and attention_kernel.covers(q, skeys, svalues)):
        # two launches instead of ~15 operations (each a host encoding on a GPU), a drafted depth's
        # biggest share of them
        return attention_kernel.attention_draft_row(q, keys, values, skeys, svalues, length, j).reshape(B, 1, H * D)
    if cpu_ext.serves(cpu_ext.ATTENTION, q, keys, values, skeys, svalues) and cpu_ext.supports(H // keys.shape[1], D):
        # one operation of the engine's own on the CPU over the rows that count (engine/cpu_ext.cpp)
        return cpu_ext.draft_attention(q, keys, values, length, skeys, svalues, j, scale).reshape(B, 1, H * D)
    Hkv, cap = keys.shape[1], keys.shape[2]
    q = q.reshape(B, Hkv, H // Hkv, D) * scale  # head h reads kv head h // G
    seen = mx.where(mx.arange(cap) < length, (q @ keys.swapaxes(-1, -2)).astype(mx.float32), -mx.inf)
    own = mx.where(mx.arange(skeys.shape[2]) <= j, (q @ skeys.swapaxes(-1, -2)).astype(mx.float32), -mx.inf)
    # softmax_rows: on the CPU through 2^ (engine/cpu_exp.py), MLX's exp costing ~2.5x as much; at
    # 2k committed rows the softmax over them was most of what the context added to a depth
    probs = softmax_rows(mx.concatenate([seen, own], axis=-1)).astype(values.dtype)
    out = probs[..., :cap] @ values + probs[..., cap:] @ svalues  # [B, Hkv, G, D]
    return out.reshape(B, 1, H * D)
