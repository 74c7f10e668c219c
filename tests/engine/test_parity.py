"""Our MLX model against the references: HF transformers (PyTorch CPU) and mlx-lm, fp32."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.loader import load_model
from tests.helpers import generate, hf_logits, parity_module

torch = parity_module("torch")
parity_module("transformers")
parity_module("mlx_lm")

PROMPT = np.random.RandomState(0).randint(0, 500, size=(1, 80))  # longer than one prefill chunk below


def our_logits(path, ids: np.ndarray, chunk: int | None = None) -> np.ndarray:
    model = load_model(path).model
    cache = model.make_cache()
    chunk = chunk or ids.shape[1]
    parts = [model(mx.array(ids[:, i : i + chunk]), cache) for i in range(0, ids.shape[1], chunk)]
    return np.array(mx.concatenate(parts, axis=1))


@pytest.mark.parametrize("fixture", ["tiny_qwen35", "tiny_qwen3"])
def test_logits_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    ref = hf_logits(path, PROMPT[0])[None]
    assert np.abs(our_logits(path, PROMPT) - ref).max() <= 1e-4
    # prompt longer than one prefill chunk: the state carries over chunks
    assert np.abs(our_logits(path, PROMPT, chunk=32) - ref).max() <= 1e-4


def test_conditional_generation_layout(tiny_qwen35_cg):
    loaded = load_model(tiny_qwen35_cg)
    assert loaded.skipped.get("vision", 0) > 0  # vision tower noted, not loaded
    ref = hf_logits(tiny_qwen35_cg, PROMPT[0, :24], conditional=True)[None]
    assert np.abs(our_logits(tiny_qwen35_cg, PROMPT[:, :24]) - ref).max() <= 1e-4


def test_incremental_decode_equals_full_forward(tiny_qwen35):
    full = our_logits(tiny_qwen35, PROMPT[:, :24])
    step = our_logits(tiny_qwen35, PROMPT[:, :24], chunk=1)
    assert np.abs(full - step).max() <= 1e-5


def test_greedy_matches_transformers_64_steps(tiny_qwen35):
    import transformers as tf

    from engine.config import EngineConfig, SamplingParams
    from engine.generate import Engine

    prompt = [int(t) for t in PROMPT[0, :30]]
    engine = Engine(EngineConfig(model_path=str(tiny_qwen35), prefill_chunk=16))
    eos = set(engine.tokenizer.eos_token_ids)
    ours = generate(engine, prompt, SamplingParams(max_tokens=64)).tokens
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_qwen35, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          eos_token_id=sorted(eos), pad_token_id=0)
    ref = [t for t in out[0, len(prompt):].tolist() if t not in eos]
    assert ours == ref[: len(ours)] and len(ours) == len(ref)


def test_matches_mlx_lm(tiny_qwen35_mlx):
    from mlx_lm import load

    ref_model, _ = load(str(tiny_qwen35_mlx))
    ids = mx.array(PROMPT[:, :40])
    ref = np.array(ref_model(ids))
    assert np.abs(our_logits(tiny_qwen35_mlx, PROMPT[:, :40]) - ref).max() <= 1e-5


def test_quantized_mlx_checkpoint_loads_and_matches(tiny_qwen35_mlx, tmp_path):
    from mlx_lm import convert, load

    out = tmp_path / "q4"
    convert(str(tiny_qwen35_mlx), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    loaded = load_model(out)
    assert loaded.quantization["bits"] == 4
    ref_model, _ = load(str(out))
    ids = mx.array(PROMPT[:, :40])
    assert np.abs(our_logits(out, PROMPT[:, :40]) - np.array(ref_model(ids))).max() <= 1e-4


def test_compiled_token_path_equals_plain(tiny_qwen35):
    """The compiled one-token layer path (fast) and the plain module path (twin) agree."""
    from engine.models.qwen3_5 import DecoderLayer

    ids = PROMPT[:, :20]
    fast = our_logits(tiny_qwen35, ids, chunk=1)
    DecoderLayer.compile_decode = False
    try:
        plain = our_logits(tiny_qwen35, ids, chunk=1)
    finally:
        DecoderLayer.compile_decode = True
    assert np.abs(fast - plain).max() <= 1e-5


def test_compiled_tree_verify_equals_plain(tiny_qwen35):
    """Tree verify through the compiled layer functions (fast) equals the plain modules (twin)."""
    from engine import forward
    from engine.models.qwen3_5 import DecoderLayer
    from engine.tree import DraftTree

    model = load_model(tiny_qwen35).model
    tree = DraftTree((7, 3, 9, 4, 3, 8), (-1, 0, 0, 1, 2, 4))
    out = {}
    for compiled in (True, False):
        DecoderLayer.compile_decode = compiled
        try:
            cache = model.make_cache()
            model.hidden(mx.array(PROMPT[:, :20]), cache)
            out[compiled] = np.array(forward.verify(model, cache, tree, 20))
        finally:
            DecoderLayer.compile_decode = True
    assert np.abs(out[True] - out[False]).max() <= 1e-5
