"""Qwen3 (attention only): the Qwen3.5 decoder without Gated DeltaNet and without the
output gate; full rotary; plain (not zero-centred) norms. Public DFlash drafters target it."""

from __future__ import annotations

import mlx.nn as nn

from engine.models import qwen3_5
from engine.models.layers import MLP, Attention, RMSNorm, RopeSpec


class ModelArgs(qwen3_5.ModelArgs):
    @classmethod
    def from_config(cls, cfg: dict) -> qwen3_5.ModelArgs:
        fields = qwen3_5.decoder_fields(cfg, default_theta=1e6, default_rotary=1.0)
        fields["partial_rotary_factor"] = 1.0  # Qwen3 rotates the whole head
        return qwen3_5.ModelArgs(**fields, layer_is_attention=(True,) * cfg["num_hidden_layers"])


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
