"""A checkpoint that cannot load says which file and key, never a bare traceback."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from engine.loader import CheckpointError, load_model


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_unsupported_model_type(tiny_qwen35, tmp_path):
    d = _copy(tiny_qwen35, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'gpt_neox'"):
        load_model(d)


def test_missing_tensor_named(tiny_qwen35, tmp_path):
    d = _copy(tiny_qwen35, tmp_path)
    w = mx.load(str(d / "model.safetensors"))
    del w["model.layers.1.linear_attn.A_log"]
    mx.save_safetensors(str(d / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.linear_attn\.A_log'"):
        load_model(d)


def test_shape_mismatch_names_file_and_key(tiny_qwen35, tmp_path):
    d = _copy(tiny_qwen35, tmp_path)
    w = mx.load(str(d / "model.safetensors"))
    w["model.norm.weight"] = mx.zeros((7,))
    mx.save_safetensors(str(d / "model.safetensors"), w)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(7,\)"):
        load_model(d)


def test_no_weights(tiny_qwen35, tmp_path):
    d = _copy(tiny_qwen35, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(d)
