"""When a verify is handed to the device while its graph is built (engine/forward.py): only on
CUDA, and only for models whose layers are large enough for the hand-over to pay."""

from __future__ import annotations

from engine import forward
from engine.loader import load_model


def test_layer_nbytes_counts_one_decoder_layer(tiny_qwen35):
    """The mean of the decoder layers' weights, embeddings and the final norm left out."""
    model = load_model(str(tiny_qwen35), "float32").model
    layers = model.model.layers
    total = sum(v.nbytes for layer in layers for v in _leaves(layer.parameters()))
    assert forward.layer_nbytes(model) == total // len(layers)
    assert forward.layer_nbytes(model) == forward.layer_nbytes(model)  # kept on the model


def test_hand_over_only_on_cuda_and_for_large_layers(tiny_qwen35, monkeypatch):
    model = load_model(str(tiny_qwen35), "float32").model
    size = forward.layer_nbytes(model)
    monkeypatch.setattr(forward, "gpu_backend", lambda: None)
    monkeypatch.setattr(forward, "VERIFY_EVAL_MIN_LAYER_BYTES", 1)
    assert forward.verify_eval_every(model) == 0  # the CPU: never
    monkeypatch.setattr(forward, "gpu_backend", lambda: "metal")
    assert forward.verify_eval_every(model) == 0  # unmeasured on Metal: never
    monkeypatch.setattr(forward, "gpu_backend", lambda: "cuda")
    assert forward.verify_eval_every(model) == forward.VERIFY_EVAL_EVERY
    monkeypatch.setattr(forward, "VERIFY_EVAL_MIN_LAYER_BYTES", size + 1)
    assert forward.verify_eval_every(model) == 0  # layers too small: handed over once


def _leaves(tree):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]
