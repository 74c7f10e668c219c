"""Model families by `model_type`. Each module provides `args_from_config(cfg) -> ModelArgs` and a
`Model` class that follows engine.models.base.CausalLM."""

from __future__ import annotations

from types import ModuleType

from engine.models import qwen3, qwen3_5

FAMILIES: dict[str, ModuleType] = {
    "qwen3_5": qwen3_5,
    "qwen3_5_text": qwen3_5,
    "qwen3": qwen3,
}
