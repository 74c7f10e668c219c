"""On the CPU the loader turns a quantized checkpoint's projections float32 where that fits in memory
(engine/loader.py cpu_dequantize, engine/models/qlinear.py dequantize_projections): the model computes
what the quantized one does to float32 rounding, speculation stays lossless, and the choice follows
the memory rule and SPRUCE_CPU_DEQUANT."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import forward
from engine import loader as loader_module
from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.convert import ConvertOptions, convert
from engine.generate import Engine
from engine.kernels import gpu_backend
from engine.loader import CheckpointError, cpu_dequantize, load_model
from engine.models.qlinear import float32_bytes
from engine.tree import DraftTree
from tests.helpers import checkpoint_maker, generate

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
TREE = DraftTree((7, 8, 9, 10, 11, 12), (-1, 0, 1, 0, 3, 1))
cpu_only = pytest.mark.skipif(gpu_backend() is not None, reason="the CPU's choice")


@pytest.fixture(scope="module", params=[(4, False), (8, True)], ids=["q4", "q8-tied"])
def quantized(request, tmp_path_factory):
    bits, tied = request.param
    src = tmp_path_factory.mktemp("dequant_src")
    checkpoint_maker().main([str(src), "--hidden", "256", "--linear-dim", "32", "--seed", "29",
                             *(["--tied"] if tied else [])])
    out = tmp_path_factory.mktemp("dequant_q") / "model"
    convert(src, out, ConvertOptions(bits=bits, group_size=64, hadamard=False), progress=False)
    return out


def logits(model: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    chain = np.array(model(mx.array([PROMPT]), model.make_cache()))[0]
    cache = model.make_cache()
    forward.extend(model, cache, PROMPT)
    return chain, np.array(forward.verify(model, cache, TREE, len(PROMPT)))


@cpu_only
def test_float32_projections_compute_what_the_quantized_ones_do(quantized):
    q = load_model(quantized, "float32", dequantize=False)
    f = load_model(quantized, "float32", dequantize=True)
    assert q.dequantized_projections == 0 and f.dequantized_projections > 0
    left = [n for n, m in f.model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert left == []  # every projection and the embedding: float32 now
    assert f.model.model.embed_tokens.weight.dtype == mx.float32
    for ours, ref in zip(logits(f.model), logits(q.model), strict=True):
        assert np.abs(ours - ref).max() <= 1e-4 * max(1.0, float(np.abs(ref).max()))
    # the CLI tells the user (spruce run / serve print the engine's load notes)
    assert q.notes == () and len(f.notes) == 1 and "SPRUCE_CPU_DEQUANT=0" in f.notes[0]


@cpu_only
@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=24, ignore_eos=True),
                                      SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_speculation_on_the_float32_copy_is_lossless(quantized, sampling, monkeypatch):
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "1")
    engine = Engine(EngineConfig(model_path=str(quantized), dtype="float32"))
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in engine.model.named_modules())
    plain = generate(engine, PROMPT, sampling).tokens
    spec = SpecConfig(method="ngram", budget=8, adaptive=False)
    assert generate(engine, PROMPT, sampling, spec).tokens == plain


@cpu_only
def test_the_memory_rule_and_the_switch(quantized, monkeypatch):
    model = load_model(quantized, "float32", dequantize=False).model
    need = float32_bytes(model)
    assert need > 0
    monkeypatch.delenv("SPRUCE_CPU_DEQUANT", raising=False)
    enough = int(need / loader_module.CPU_DEQUANT_MEMORY_SHARE)
    monkeypatch.setattr(loader_module, "physical_memory", lambda: enough + 1)
    assert cpu_dequantize(model)
    monkeypatch.setattr(loader_module, "physical_memory", lambda: enough - 1)
    assert not cpu_dequantize(model)
    assert load_model(quantized, "float32").dequantized_projections == 0  # too big: kept quantized
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "1")
    assert cpu_dequantize(model)
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "0")
    monkeypatch.setattr(loader_module, "physical_memory", lambda: 1 << 50)
    assert not cpu_dequantize(model)
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "yes")
    with pytest.raises(CheckpointError, match="SPRUCE_CPU_DEQUANT"):
        cpu_dequantize(model)


@cpu_only
def test_a_bf16_request_keeps_the_quantized_kernels(quantized, monkeypatch):
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "1")
    assert load_model(quantized, "bfloat16").dequantized_projections == 0


@pytest.mark.skipif(gpu_backend() is None, reason="the GPU's choice")
def test_never_on_a_gpu(quantized, monkeypatch):
    monkeypatch.setenv("SPRUCE_CPU_DEQUANT", "1")
    assert not cpu_dequantize(load_model(quantized, dequantize=False).model)
