"""scripts/widen_checkpoint.py: the bundled target, MTP head and DFlash drafter zero-padded to a wider
Qwen3.5 shape compute what the small ones compute, so the bundled drafters guess as well on it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.config import EngineConfig, SamplingParams, SpecConfig
from engine.generate import BUNDLED, Engine
from engine.loader import load_model
from engine.types import GenerationRequest
from server.chat import ChatRenderOptions, ChatTemplate

REPO = Path(__file__).resolve().parents[2]


def _script(name: str):
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def widen():
    return _script("widen_checkpoint")


@pytest.fixture(scope="module")
def maps():
    return _script("widen_maps")


@pytest.fixture(scope="module")
def wide(widen, tmp_path_factory):
    out = tmp_path_factory.mktemp("wide") / "w"
    widen.widen(out, "test", dtype=mx.float32)
    return out


def test_rotated_dims_keep_their_frequencies(maps):
    # a small head (64 dims, 16 rotated) placed in a wide one (128, 32): RoPE of the placed head is
    # the placed RoPE of the small head, at every position
    rng = np.random.default_rng(0)
    small = mx.array(rng.standard_normal((1, 1, 5, 64)).astype(np.float32))
    index = maps.head_dim_map(64, 128, 16, 32)
    assert len(set(index.tolist())) == 64 and index.max() < 128
    placed = mx.zeros((1, 1, 5, 128))
    placed[..., mx.array(index)] = small
    for offset in (0, 7, 1000):
        turned = mx.fast.rope(small, 16, traditional=False, base=1e7, scale=1.0, offset=offset)
        turned_wide = mx.fast.rope(placed, 32, traditional=False, base=1e7, scale=1.0, offset=offset)
        assert np.allclose(np.array(turned_wide[..., mx.array(index)]), np.array(turned), atol=1e-5)
        rest = np.setdiff1d(np.arange(128), index)
        assert np.abs(np.array(turned_wide[..., mx.array(rest)])).max() == 0


def test_query_heads_keep_their_kv_group(maps):
    m = maps.query_head_map(6, 2, 8, 2)  # 3 query heads a K/V head -> 4
    assert m.tolist() == [0, 1, 2, 4, 5, 6]
    assert [h // 4 for h in m] == [h // 3 for h in range(6)]
    with pytest.raises(ValueError):
        maps.query_head_map(8, 2, 8, 4)  # 4 a group cannot fit in 2


def test_the_wide_target_computes_the_small_one(wide):
    small = load_model(BUNDLED / "target", dtype="float32").model
    big = load_model(wide / "target", dtype="float32").model
    assert big.args.hidden_size > small.args.hidden_size and len(big.model.layers) > len(small.model.layers)
    tokens = mx.array(np.random.default_rng(1).integers(3, 8000, 64))[None]
    h_small = small.hidden(tokens, small.make_cache())
    h_big = big.hidden(tokens, big.make_cache())
    d = small.args.hidden_size
    assert float(mx.abs(h_big[..., d:]).max()) == 0.0  # the padded stream stays empty
    # the eps of the norms over the stream moves a little (one eps for all norms): ~1e-3
    assert float(mx.abs(h_big[..., :d] - h_small).max()) < 1e-2
    a, b = small.logits(h_small), big.logits(h_big)
    assert float(mx.abs(a - b).max()) < 0.05 * float(mx.abs(a).max())
    assert (a.argmax(-1) == b.argmax(-1)).all().item()


def _generate(model: Path, dflash: Path, spec: str) -> tuple[list[int], float]:
    engine = Engine(EngineConfig(model_path=str(model), dtype="float32", spec=SpecConfig(dflash_model=str(dflash))))
    template = ChatTemplate(engine.tokenizer.chat_template)
    text = "Write a python function to return the number of lines in a text file"
    prompt = engine.tokenizer.encode(template.render([{"role": "user", "content": text}],
                                                     ChatRenderOptions(enable_thinking=False)))
    req = GenerationRequest(prompt_ids=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=32),
                            spec=SpecConfig(method=spec, tree="chain", budget=8, adaptive=False,
                                            dflash_model=str(dflash)))
    tokens = []
    for step in engine.generate(req):
        tokens += step.token_ids
    return tokens, step.stats.tokens_per_forward


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_the_bundled_drafters_guess_the_same_on_the_wide_target(wide, method):
    small = _generate(BUNDLED / "target", BUNDLED / "dflash", method)
    big = _generate(wide / "target", wide / "dflash", method)
    assert big[0] == small[0]
    assert big[1] == pytest.approx(small[1])
    assert small[1] > 2  # the drafters guess here at all, so the equality says something


@pytest.fixture(scope="module")
def wide8(widen, tmp_path_factory):
    out = tmp_path_factory.mktemp("wide8") / "w"
    widen.widen(out, "test", dtype=mx.float32, quant=widen.Quantization(bits=8))
    return out


def test_a_quantized_wide_target_keeps_the_padding_exact_and_the_tokens(wide8):
    # `--bits`: projections quantized as mlx-community checkpoints are; padded blocks stay exactly
    # zero, so the only change is the real weights' rounding
    small = load_model(BUNDLED / "target", dtype="float32").model
    big = load_model(wide8 / "target", dtype="float32", dequantize=False).model  # as stored
    assert isinstance(big.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert not isinstance(big.model.embed_tokens, nn.QuantizedEmbedding)
    tokens = mx.array(np.random.default_rng(1).integers(3, 8000, 64))[None]
    h_small, h_big = small.hidden(tokens, small.make_cache()), big.hidden(tokens, big.make_cache())
    d = small.args.hidden_size
    assert float(mx.abs(h_big[..., d:]).max()) == 0.0
    agree = (small.logits(h_small).argmax(-1) == big.logits(h_big).argmax(-1)).mean().item()
    assert agree > 0.9


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_the_bundled_drafters_still_guess_on_a_quantized_wide_target(wide8, method):
    tokens, per_forward = _generate(wide8 / "target", wide8 / "dflash", method)
    assert len(tokens) == 32 and per_forward > 2
