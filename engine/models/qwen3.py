"""Qwen3 (attention only): the Qwen3.5 decoder without Gated DeltaNet and without the
output gate; full rotary; plain (not zero-centred) norms. Public DFlash drafters target it."""

from __future__ import annotations

import mlx.nn as nn

from engine.models import qwen3_5
from engine.models.layers import MLP, Attention, RMSNorm, RopeSpec


class ModelArgs(qwen3_5.ModelArgs):
    @classmethod
    def from_config(cls, cfg: dict) -> "qwen3_5.ModelArgs":
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        return qwen3_5.ModelArgs(
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
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e6))),
            partial_rotary_factor=1.0,
            layer_is_attention=(True,) * cfg["num_hidden_layers"],
        )


class DecoderLayer(qwen3_5.DecoderLayer):
    def __init__(self, a: qwen3_5.ModelArgs, is_attention: bool) -> None:
        nn.Module.__init__(self)
        self.is_attention = True
        rope = RopeSpec(a.head_dim, a.rope_theta)
        self.self_attn = Attention(a.hidden_size, a.num_attention_heads, a.num_key_value_heads,
                                   a.head_dim, a.rms_norm_eps, rope, output_gate=False)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a.hidden_size, a.intermediate_size)


class Model(qwen3_5.Model):
    zero_centred_norms = ()

    @staticmethod
    def layer_class():
        return DecoderLayer
