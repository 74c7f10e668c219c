"""The prefill chunk: the backend's default unless the config names one."""

from __future__ import annotations

import pytest

from engine import prefill
from engine.config import EngineConfig
from engine.kernels import gpu_backend


def test_default_follows_the_backend(monkeypatch):
    expected = prefill.CPU_PREFILL_CHUNK if gpu_backend() is None else prefill.GPU_PREFILL_CHUNK
    assert prefill.default_prefill_chunk() == expected
    monkeypatch.setattr(prefill, "gpu_backend", lambda: "cuda")
    assert prefill.default_prefill_chunk() == prefill.GPU_PREFILL_CHUNK
    monkeypatch.setattr(prefill, "gpu_backend", lambda: None)
    assert prefill.default_prefill_chunk() == prefill.CPU_PREFILL_CHUNK


def test_config_takes_zero_for_the_default_and_refuses_negatives():
    assert EngineConfig(model_path="m").prefill_chunk == 0
    assert EngineConfig(model_path="m", prefill_chunk=64).prefill_chunk == 64
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(model_path="m", prefill_chunk=-1)


def test_the_engine_resolves_it(tiny_qwen35):
    from engine.generate import Engine

    assert Engine(EngineConfig(model_path=str(tiny_qwen35))).prefill_chunk == prefill.default_prefill_chunk()
    assert Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16)).prefill_chunk == 16
