"""Embeddings of a prompt: the mean of the model's final-norm hidden states over its tokens,
L2-normalised (mean pooling, as llama.cpp's `--pooling mean`). Computed in a fresh cache, in
prefill chunks; the prefix cache is neither read nor written (nothing is generated after it)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from engine.forward import state_arrays
from engine.models.base import CausalLM
from engine.types import Stats, Step


def embed(model: CausalLM, ids: list[int], chunk: int) -> np.ndarray:
    """float32 [hidden]: the normalised mean hidden state of `ids`."""
    cache = model.make_cache()
    total = mx.zeros((model.args.hidden_size,), dtype=mx.float32)
    for i in range(0, len(ids), chunk):
        h = model.hidden(mx.array([ids[i : i + chunk]]), cache)[0].astype(mx.float32)
        total = total + h.sum(axis=0)
        mx.eval(total, state_arrays(cache))
    mean = np.array(total / len(ids), dtype=np.float32)
    norm = float(np.linalg.norm(mean))
    return mean / norm if norm > 0 else mean


def embed_step(model: CausalLM, ids: list[int], chunk: int) -> Step:
    t0 = time.perf_counter()
    vector = embed(model, ids, chunk)
    ms = (time.perf_counter() - t0) * 1e3
    stats = Stats(prompt_tokens=len(ids), prompt_ms=ms, ttft_ms=ms)
    return Step(token_ids=[], finish_reason="stop", stats=stats, embedding=vector.tolist())
