"""A checkpoint's own sampling defaults (`generation_config.json`), for requests that set none.

vLLM applies the same keys the same way: a request's value wins, else the checkpoint's, else the
API's default (and, as in vLLM, `do_sample` is not read). Only the keys HF's generate() defines and
Spruce applies are read; a value of the wrong type or range is ignored (checkpoint data is
tolerated, not trusted).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


_RANGES = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
           "repetition_penalty": (1e-6, 10.0)}


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    try:
        cfg = json.loads((model_dir / "generation_config.json").read_text())
    except (OSError, ValueError):
        return SamplingDefaults()
    if not isinstance(cfg, dict):
        return SamplingDefaults()
    top_k = cfg.get("top_k")
    return SamplingDefaults(
        temperature=_float(cfg, "temperature"), top_p=_float(cfg, "top_p"),
        top_k=top_k if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0 else None,
        min_p=_float(cfg, "min_p"), repetition_penalty=_float(cfg, "repetition_penalty"))


def _float(cfg: dict, key: str) -> float | None:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    low, high = _RANGES[key]
    return float(value) if low <= value <= high else None
