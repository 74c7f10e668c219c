"""Qwen3 (attention only): the Qwen3.5 decoder without Gated DeltaNet and without the
output gate; full rotary; plain (not zero-centred) norms. Public DFlash drafters target it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.models import qwen3_5
from engine.models.base import ModelArgs, decoder_fields


def args_from_config(cfg: dict[str, Any]) -> ModelArgs:
    fields = decoder_fields(cfg, default_theta=1e6, default_rotary=1.0)
    fields["partial_rotary_factor"] = 1.0  # Qwen3 rotates the whole head
    return ModelArgs(**fields, layer_is_attention=(True,) * cfg["num_hidden_layers"])


class DecoderLayer(qwen3_5.DecoderLayer):
    attention_output_gate = False


class Model(qwen3_5.Model):
    layer_class = DecoderLayer

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
