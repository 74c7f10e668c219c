"""What every model family provides: its arguments record and the causal-LM protocol the engine,
the drafters and the loader program against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from engine.cache import LayerCache
from engine.models.layers import Batch


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float
    partial_rotary_factor: float
    layer_is_attention: tuple[bool, ...]
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4


def decoder_fields(cfg: dict[str, Any], default_theta: float, default_rotary: float) -> dict[str, Any]:
    """The ModelArgs fields every decoder family reads the same way from a (text) config."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    heads = cfg["num_attention_heads"]
    return dict(
        model_type=cfg["model_type"],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", default_theta))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             cfg.get("partial_rotary_factor", default_rotary))),
    )


class CausalLM(Protocol):
    """tokens [1, T] + caches + how the rows relate to them (Batch) -> hidden states / logits."""

    args: ModelArgs

    def make_cache(self) -> list[LayerCache]: ...

    def hidden(self, tokens: mx.array, cache: list[LayerCache], batch: Batch = ...) -> mx.array:
        """Final-norm hidden states [1, T, H]."""
        ...

    def logits(self, h: mx.array) -> mx.array: ...

    def __call__(self, tokens: mx.array, cache: list[LayerCache], batch: Batch = ...) -> mx.array:
        """Logits [1, T, V]."""
        ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Checkpoint tensors (names already canonical) -> this model's parameters: layouts and
        conventions that differ between HF and MLX checkpoints are resolved here."""
        ...
