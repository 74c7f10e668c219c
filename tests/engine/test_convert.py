"""`spruce convert`: layout, what is quantized and what is not, the Hadamard rotation (with no
quantization it must reproduce the unrotated model's logits: that is the test that every rotation
sits where docs/hadamard.md says), MTP tensors kept, and the output loads in mlx-lm."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine.convert import ConvertError, ConvertOptions, convert
from engine.loader import load_model
from tests.helpers import parity_module

PROMPT = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]]


def logits(path) -> np.ndarray:
    model = load_model(path, "float32").model
    return np.array(model(mx.array(PROMPT), model.make_cache()))[0]


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(P || Q) over positions, from logits."""
    lp = p_logits - np.log(np.exp(p_logits - p_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - p_logits.max(-1, keepdims=True)
    lq = q_logits - np.log(np.exp(q_logits - q_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - q_logits.max(-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


@pytest.fixture(params=["tiny_qwen35", "tiny_qwen35_cg", "tiny_qwen3"])
def source(request):
    return request.getfixturevalue(request.param)


def test_hadamard_without_quantization_keeps_the_logits(source, tmp_path):
    report = convert(source, tmp_path / "out", ConvertOptions(bits=None, hadamard=True), progress=False)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    layers = cfg.get("text_config", cfg)["num_hidden_layers"]
    assert report.rotated_online == 2 * layers  # every layer: the mixer's output projection and down_proj
    assert cfg["tie_word_embeddings"] is False and cfg["spruce_rotation"]["block"] == 32
    loaded = load_model(tmp_path / "out", "float32")
    assert loaded.rotated_inputs == 2 * layers
    np.testing.assert_allclose(logits(tmp_path / "out"), logits(source), atol=2e-4)


def test_8bit_stays_close_with_and_without_hadamard(tiny_qwen35, tmp_path):
    ref = logits(tiny_qwen35)
    for hadamard in (False, True):
        out = tmp_path / f"q8_{hadamard}"
        convert(tiny_qwen35, out, ConvertOptions(bits=8, group_size=32, hadamard=hadamard), progress=False)
        got = logits(out)
        assert kl(ref, got) < 1e-3
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_layout_and_what_stays_unquantized(tiny_qwen35, tmp_path):
    out = tmp_path / "q4"
    report = convert(tiny_qwen35, out, ConvertOptions(bits=4, group_size=64), progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5"  # what mlx-lm reads
    assert cfg["quantization"] == cfg["quantization_config"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    w = mx.load(str(out / "model.safetensors"))
    assert all(k.startswith("language_model.") for k in w)
    quantized = {k[: -len(".scales")] for k in w if k.endswith(".scales")}
    assert report.quantized == len(quantized)
    prefix = "language_model.model.layers.0."
    assert prefix + "mlp.down_proj" in quantized and prefix + "linear_attn.in_proj_qkv" in quantized
    assert "language_model.model.embed_tokens" in quantized and "language_model.lm_head" in quantized
    assert w[prefix + "mlp.down_proj.weight"].dtype == mx.uint32
    for name in ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight", "linear_attn.norm.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"):
        assert prefix + name in w and prefix + name.rsplit(".", 1)[0] not in quantized, name
    assert w[prefix + "linear_attn.conv1d.weight"].shape[-1] == 1  # MLX [C, K, 1]
    assert w[prefix + "linear_attn.A_log"].dtype == mx.float32
    src = mx.load(str(tiny_qwen35 / "model.safetensors"))
    np.testing.assert_allclose(np.array(w[prefix + "input_layernorm.weight"]),
                               np.array(src["model.layers.0.input_layernorm.weight"]) + 1.0, atol=1e-6)
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_mlx_lm_loads_the_output(tiny_qwen35, tmp_path, bits):
    mlx_lm_load = parity_module("mlx_lm.utils").load_model

    out = tmp_path / "out"
    convert(tiny_qwen35, out, ConvertOptions(bits=bits, group_size=32), progress=False)
    model, _ = mlx_lm_load(out)
    model.set_dtype(mx.float32)
    theirs = np.array(model(mx.array(PROMPT)))[0]
    np.testing.assert_allclose(theirs, logits(out), atol=1e-4)


def test_mlx_lm_refuses_run_time_rotations(tiny_qwen35, tmp_path):
    mlx_lm_load = parity_module("mlx_lm.utils").load_model

    convert(tiny_qwen35, tmp_path / "out", ConvertOptions(bits=8, hadamard=True), progress=False)
    with pytest.raises(ValueError, match="input_signs"):
        mlx_lm_load(tmp_path / "out")


MTP = {"mtp.fc.weight": (64, 128), "mtp.pre_fc_norm_embedding.weight": (64,), "mtp.pre_fc_norm_hidden.weight": (64,),
       "mtp.norm.weight": (64,), "mtp.layers.0.input_layernorm.weight": (64,),
       "mtp.layers.0.self_attn.q_proj.weight": (128, 64), "mtp.layers.0.mlp.down_proj.weight": (64, 192)}


def test_mtp_kept_vision_skipped(tiny_qwen35_cg, tmp_path):
    src = tmp_path / "with_mtp"
    shutil.copytree(tiny_qwen35_cg, src)
    rng = np.random.default_rng(0)
    mtp = {k: mx.array(rng.standard_normal(s).astype(np.float32) * 0.1) for k, s in MTP.items()}
    mx.save_safetensors(str(src / "mtp.safetensors"), mtp)
    vision = [k for k in mx.load(str(src / "model.safetensors")) if "visual" in k]
    assert vision
    report = convert(src, tmp_path / "out", ConvertOptions(bits=4, group_size=32), progress=False)
    assert report.mtp_kept == len(MTP) and report.vision_skipped == len(vision)
    w = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert not any("visual" in k for k in w)
    for k, v in mtp.items():
        expected = np.array(v) + (1.0 if k.endswith("norm.weight") else 0.0)  # zero-centred like the model's
        np.testing.assert_allclose(np.array(w[k]), expected, atol=1e-6)
    np.testing.assert_allclose(logits(tmp_path / "out"), logits(tiny_qwen35_cg), atol=1.0)  # 4-bit: loads, close


def test_sharded_output_has_an_index(tiny_qwen35, tmp_path):
    out = tmp_path / "out"
    report = convert(tiny_qwen35, out, ConvertOptions(bits=None, max_shard_bytes=200_000), progress=False)
    assert len(report.files) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in report.files}
    np.testing.assert_array_equal(logits(out), logits(tiny_qwen35))


def test_refusals_name_the_problem(tiny_qwen35, tmp_path):
    convert(tiny_qwen35, tmp_path / "q", ConvertOptions(bits=4, group_size=32), progress=False)
    with pytest.raises(ConvertError, match="already quantized"):
        convert(tmp_path / "q", tmp_path / "q2", ConvertOptions(), progress=False)
    with pytest.raises(ConvertError, match="already exists"):
        convert(tiny_qwen35, tmp_path / "q", ConvertOptions(), progress=False)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ConvertOptions(bits=3)
    with pytest.raises(ValueError, match="group size"):
        ConvertOptions(group_size=48)


def test_hadamard_needs_blocks_of_32(tmp_path):
    from tests.helpers import checkpoint_maker

    src = tmp_path / "odd"
    checkpoint_maker().main([str(src), "--hidden", "64", "--intermediate", "144"])
    with pytest.raises(ConvertError, match="intermediate_size is 144"):
        convert(src, tmp_path / "out", ConvertOptions(hadamard=True), progress=False)


def test_a_failed_conversion_leaves_nothing_behind(tiny_qwen35, tmp_path):
    src = tmp_path / "truncated"
    shutil.copytree(tiny_qwen35, src)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # the header is intact, half the tensors are not there
    with pytest.raises(ConvertError, match="cannot read model.safetensors: .*incomplete"):
        convert(src, tmp_path / "out", ConvertOptions(bits=8), progress=False)
    assert not (tmp_path / "out").exists()


def test_the_draft_vocabulary_is_copied_beside_not_into_the_weights(tmp_path):
    """The bundled target carries draft_vocab.safetensors: the output keeps it as a file of its own
    (merged into the weights, its `ranked_ids` made mlx-lm refuse the checkpoint), Spruce's drafters
    still find it, and mlx-lm loads the output."""
    from engine.drafters.draft_vocab import FILE
    from engine.generate import BUNDLED

    src = BUNDLED / "target"
    out = tmp_path / "out"
    convert(src, out, ConvertOptions(bits=4, group_size=64), progress=False)
    assert (out / FILE).read_bytes() == (src / FILE).read_bytes()
    keys = set(mx.load(str(out / "model.safetensors")).keys())
    assert not any("ranked_ids" in k for k in keys)
    model, _ = parity_module("mlx_lm.utils").load_model(out)
    assert model is not None
