"""DFlash block drafter (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding").

A few Qwen3-style layers read a block `[root, MASK x (block_size - 1)]` embedded with the
target's embedding, and return hidden states that the target's lm_head turns into marginals
for the next block_size - 1 positions, all in one pass. The context is the target's own hidden
states: the residual stream after `target_layer_ids`, concatenated, projected by `fc` and
normalised by `hidden_norm`, then injected as extra keys/values into every layer ("KV
injection"); queries come from the block only. Full-attention layers see the whole block
(bidirectional); sliding-window layers, unless `is_causal` says otherwise, are causal inside the
block and see only the last `sliding_window` positions.

Checkpoints load as z-lab publishes them (architecture `DFlashDraftModel`, HF `config.json` with
the DFlash keys nested in `dflash_config` or at the top level; tensors `fc`, `hidden_norm`,
`norm`, `layers.N.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, mlp.{gate,up,down}_proj}`; no embedding, no lm_head). Norms are plain
(Qwen3) RMSNorms. The context K/V of committed positions live in one KVCache per layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import cpu_ext
from engine.cache import KVCache
from engine.models.layers import MLP, RMSNorm, attention_parts
from engine.models.linear import Linear

SUPPORTED_ARCHITECTURES = ("DFlashDraftModel",)
# module switch, read when a block is traced: on the CPU the block attends over the context buffer
# and its own rows without concatenating them (layers.attention_parts); False: the fused kernel
# over the concatenation, its twin (tests hold the two equal)
SPLIT_ON_CPU = True
LAYER_TYPES = ("full_attention", "sliding_attention")


class DFlashConfigError(ValueError):
    """A DFlash checkpoint this code cannot run; the message names the key."""


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal in the block, full layers not
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    num_target_layers: int | None = None

    def layer_is_causal(self, i: int) -> bool:
        sliding = self.layer_types[i] == "sliding_attention"
        return sliding if self.is_causal is None else self.is_causal

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def config_from_dict(cfg: dict[str, Any]) -> DFlashConfig:
    """HF config dict -> DFlashConfig. DFlash keys may sit in `dflash_config` or at the top level."""
    arch = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise DFlashConfigError(f"unsupported DFlash architecture {arch!r} (supported: {SUPPORTED_ARCHITECTURES})")
    nested = cfg.get("dflash_config") or {}

    def dflash(key: str, default: Any = None) -> Any:
        return nested.get(key, cfg.get(key, default))

    try:
        n = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        ids = dflash("target_layer_ids")
        mask = dflash("mask_token_id")
        if ids is None or mask is None:
            raise KeyError("target_layer_ids" if ids is None else "mask_token_id")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise DFlashConfigError(f"rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        layer_types = tuple(cfg.get("layer_types") or ("full_attention",) * n)
        config = DFlashConfig(
            hidden_size=int(cfg["hidden_size"]), num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            block_size=int(dflash("block_size", 16)), mask_token_id=int(mask),
            target_layer_ids=tuple(int(i) for i in ids), layer_types=layer_types,
            sliding_window=cfg.get("sliding_window"),
            is_causal=None if cfg.get("is_causal", nested.get("is_causal")) is None
            else bool(cfg.get("is_causal", nested.get("is_causal"))),
            input_embedding_scale=float(dflash("input_embedding_scale", 1.0)),
            output_multiplier=float(dflash("output_multiplier", 1.0)),
            final_logit_softcapping=dflash("final_logit_softcapping"),
            num_target_layers=cfg.get("num_target_layers"),
        )
    except KeyError as e:
        raise DFlashConfigError(f"DFlash config: missing key {e.args[0]!r}") from None
    if len(config.layer_types) != n or set(config.layer_types) - set(LAYER_TYPES):
        raise DFlashConfigError(f"DFlash config: layer_types {config.layer_types} for {n} layers")
    if "sliding_attention" in config.layer_types and not config.sliding_window:
        raise DFlashConfigError("DFlash config: sliding_attention layers need sliding_window")
    if config.block_size < 2:
        raise DFlashConfigError(f"DFlash config: block_size must be >= 2, got {config.block_size}")
    return config


def read_config(path: str | Path) -> DFlashConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise DFlashConfigError(f"{path} has no config.json (is it a DFlash checkpoint directory?)")
    try:
        return config_from_dict(json.loads(cfg_file.read_text()))
    except json.JSONDecodeError as e:
        raise DFlashConfigError(f"{cfg_file} is not valid JSON: {e}") from None


def block_mask(ctx_len: int, capacity: int, block: int, causal: bool, window: int | None) -> np.ndarray:
    """bool [block, capacity + block]: which keys each block row sees. Keys are the context buffer
    (rows past ctx_len are unused capacity) followed by the block's own rows."""
    q = ctx_len + np.arange(block)[:, None]
    k = np.concatenate([np.arange(capacity), ctx_len + np.arange(block)])[None, :]
    visible = np.concatenate([np.arange(capacity) < ctx_len, np.ones(block, dtype=bool)])[None, :]
    visible = np.broadcast_to(visible, (block, capacity + block))
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig, index: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.theta, self.scale = c.rope_theta, c.head_dim**-0.5
        self.causal, self.window = c.layer_is_causal(index), c.layer_window(index)
        H = c.hidden_size
        self.q_proj = Linear(H, self.heads * self.head_dim, bias=False)
        self.k_proj = Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(H, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.heads * self.head_dim, H, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.theta, scale=1.0, offset=offset)

    def _kv(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """x [1, T, H] -> keys (normed, rotated from `offset`) and values, [1, kv_heads, T, D]."""
        T = x.shape[1]
        k = self.k_norm(self.k_proj(x).reshape(1, T, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(1, T, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self._rope(k, offset), v

    def append_context(self, ctx: mx.array, cache: KVCache) -> None:
        """Projected target context rows [1, T, H] of the next committed positions -> the cache."""
        k, v = self._kv(ctx, cache.offset)
        cache.write(k, v)
        cache.advance(ctx.shape[1])

    def _in_one_operation(self, q: mx.array, k_ctx: mx.array) -> bool:
        """Whether the block attends in the CPU's own operation (cpu_ext.ATTENTION, float32, a head
        shape it is built for): where every row sees the context's rows before `offset` and the
        whole block, i.e. not causal and not windowed, and there is a context buffer."""
        return (not self.causal and self.window is None and k_ctx.shape[2] > 0
                and cpu_ext.serves(cpu_ext.ATTENTION, q, k_ctx)
                and cpu_ext.supports(self.heads // self.kv_heads, self.head_dim))

    def __call__(self, x: mx.array, offset: mx.array, k_ctx: mx.array, v_ctx: mx.array, mask: mx.array) -> mx.array:
        """Block rows x [1, B, H] at positions offset + i (offset: int32 [1]) against the context
        buffers [1, kv_heads, capacity, D] and themselves; mask [B, capacity + B] (block_mask)."""
        B = x.shape[1]
        q = self.q_norm(self.q_proj(x).reshape(1, B, self.heads, -1)).transpose(0, 2, 1, 3)
        q = self._rope(q, offset)
        k, v = self._kv(x, offset)
        if self._in_one_operation(q, k_ctx):
            # the engine's own CPU operation (engine/cpu_ext.cpp draft_attention): the context's
            # first `offset` rows and the whole block, read once for the block's rows, no scores
            # through memory; the mask says no more than that for a bidirectional, unwindowed layer
            out = cpu_ext.draft_attention(q, k_ctx, v_ctx, offset, k, v, mx.array(B - 1, dtype=mx.int32), self.scale)
        elif SPLIT_ON_CPU and mx.default_device() == mx.cpu:
            out = attention_parts(q, (k_ctx, k), (v_ctx, v), self.scale, mask)
        else:  # on a GPU the fused kernel (the split form was not measured there)
            keys, values = mx.concatenate([k_ctx, k], axis=2), mx.concatenate([v_ctx, v], axis=2)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig, index: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(c, index)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def __call__(self, x: mx.array, offset: mx.array, k_ctx: mx.array, v_ctx: mx.array, mask: mx.array) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), offset, k_ctx, v_ctx, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The draft network; the target's embedding and lm_head are lent by the drafter."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = [DFlashLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self._block_fns: dict[tuple[bool, bool, bool], Callable[..., mx.array]] = {}

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def append_context(self, features: mx.array, cache: list[KVCache]) -> None:
        """features [T, n_ids * H]: the target's tapped hidden states of the next committed
        positions, in target_layer_ids order."""
        ctx = self.hidden_norm(self.fc(features[None]))
        for layer, c in zip(self.layers, cache, strict=True):
            layer.self_attn.append_context(ctx, c)

    def block(self, embedded: mx.array, cache: list[KVCache]) -> mx.array:
        """embedded [1, B, H] (the block's embeddings, already scaled) -> final hidden [1, B, H].
        The block sits at positions ctx_len + i and sees the whole context; its K/V are not kept."""
        c, ctx_len, B = self.config, cache[0].offset, embedded.shape[1]
        empty = mx.zeros((1, c.num_key_value_heads, 0, c.head_dim), embedded.dtype)
        kv: list[mx.array] = []
        for layer_cache in cache:  # whole buffers: their shapes change rarely, so do the traces
            keys, values = layer_cache.keys, layer_cache.values
            kv += [empty, empty] if ctx_len == 0 or keys is None or values is None else [keys, values]
        capacity = kv[0].shape[2]
        kinds = [(layer.self_attn.causal, layer.self_attn.window) for layer in self.layers]
        masks = {kind: mx.array(block_mask(ctx_len, capacity, B, *kind)) for kind in set(kinds)}
        layer_masks = [masks[kind] for kind in kinds]
        return self._compiled_block(embedded, mx.array([ctx_len], dtype=mx.int32), *kv, *layer_masks)

    def _block(self, x: mx.array, offset: mx.array, *arrays: mx.array) -> mx.array:
        n = len(self.layers)
        kv, masks = arrays[: 2 * n], arrays[2 * n :]
        for i, layer in enumerate(self.layers):
            x = layer(x, offset, kv[2 * i], kv[2 * i + 1], masks[i])
        return self.norm(x)

    @property
    def _compiled_block(self) -> Callable[..., mx.array]:
        # compiled on first use (after the weights are loaded); traced again only when the context
        # buffers grow (every KV_STEP rows). One compiled function for each setting of the switches
        # the trace reads: SPLIT_ON_CPU and the CPU's attention and softmax (engine/cpu_ext.py)
        key = (SPLIT_ON_CPU, bool(cpu_ext.ATTENTION), bool(cpu_ext.SOFTMAX))
        if key not in self._block_fns:
            self._block_fns[key] = mx.compile(self._block)
        return self._block_fns[key]

    def scale_logits(self, logits: mx.array) -> mx.array:
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            cap = float(c.final_logit_softcapping)
            logits = mx.tanh(logits / cap) * cap
        return logits
