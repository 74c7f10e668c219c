"""Model families by `model_type`. Each maps (tokens, cache, tree) -> logits."""

from __future__ import annotations

from engine.models import qwen3, qwen3_5

# model_type -> module with ModelArgs.from_config and Model
FAMILIES = {
    "qwen3_5": qwen3_5,
    "qwen3_5_text": qwen3_5,
    "qwen3": qwen3,
}
