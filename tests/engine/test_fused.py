"""Fused same-input projections (engine/models/fused.py) against the separate ones they replace:
the same logits over a chain and over a verified tree, plain and quantized checkpoints, and
projections of different kinds left alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine import forward
from engine.convert import ConvertOptions, convert
from engine.loader import load_model
from engine.models.fused import FusedProjection, can_fuse, fuse_into
from engine.tree import DraftTree
from tests.helpers import check_backend_default_switch

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
TREE = DraftTree((7, 8, 9, 10, 11, 12), (-1, 0, 1, 0, 3, 1))


def outputs(path, fuse: bool) -> tuple[np.ndarray, np.ndarray, int]:
    loaded = load_model(path, "float32", fuse=fuse)
    model = loaded.model
    chain = np.array(model(mx.array([PROMPT]), model.make_cache()))[0]
    cache = model.make_cache()
    forward.extend(model, cache, PROMPT)
    tree = np.array(forward.verify(model, cache, TREE, len(PROMPT)))
    return chain, tree, loaded.fused_projections


@pytest.fixture(params=["plain", "q4", "q8"])
def checkpoint(request, tiny_qwen35, tmp_path_factory):
    if request.param == "plain":
        return tiny_qwen35
    out = tmp_path_factory.mktemp(f"fused_{request.param}") / "model"
    bits = int(request.param[1:])
    convert(tiny_qwen35, out, ConvertOptions(bits=bits, group_size=32, hadamard=False), progress=False)
    return out


def test_fused_model_computes_what_the_separate_one_does(checkpoint):
    chain, tree, fused = outputs(checkpoint, True)
    chain_ref, tree_ref, none = outputs(checkpoint, False)
    assert none == 0 and fused > 0
    np.testing.assert_allclose(chain, chain_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tree, tree_ref, rtol=1e-5, atol=1e-5)
    assert (chain.argmax(-1) == chain_ref.argmax(-1)).all() and (tree.argmax(-1) == tree_ref.argmax(-1)).all()


def test_every_layer_fuses_its_mixer_and_mlp(tiny_qwen35):
    loaded = load_model(tiny_qwen35, "float32", fuse=True)
    layers = loaded.model.model.layers
    assert loaded.fused_projections == 2 * len(layers)
    for layer in layers:
        mixer = layer.self_attn if layer.is_attention else layer.linear_attn
        assert "fused" in mixer and "fused" in layer.mlp
        assert "gate_proj" not in layer.mlp and "q_proj" not in mixer and "in_proj_qkv" not in mixer


def test_fusion_is_on_by_default_only_on_cuda_and_can_be_chosen(tiny_qwen35, monkeypatch):
    check_backend_default_switch(monkeypatch, "SPRUCE_FUSE",
                                 lambda: load_model(tiny_qwen35, "float32").fused_projections)


def test_projection_split_matches_each_part():
    rng = np.random.default_rng(0)
    parts = [nn.Linear(64, n, bias=False) for n in (48, 16, 8)]
    x = mx.array(rng.normal(size=(3, 64)).astype(np.float32))
    fused = FusedProjection(parts)
    for got, p in zip(fused(x), parts, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(p(x)), rtol=1e-5, atol=1e-6)
    q = [nn.QuantizedLinear(64, n, bias=False, group_size=32, bits=4) for n in (32, 8)]
    for got, p in zip(FusedProjection(q)(x), q, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(p(x)), rtol=1e-5, atol=1e-5)


def test_mixed_kinds_stay_separate():
    owner = nn.Module()
    owner.a = nn.Linear(32, 8, bias=False)
    owner.b = nn.QuantizedLinear(32, 8, bias=False, group_size=32, bits=4)
    assert not can_fuse([owner.a, owner.b]) and not fuse_into(owner, ("a", "b"))
    assert "a" in owner and "b" in owner and "fused" not in owner
    assert not can_fuse([nn.Linear(32, 8, bias=True), nn.Linear(32, 8, bias=True)])
    assert not can_fuse([nn.QuantizedLinear(64, 8, bias=False, group_size=32, bits=4),
                         nn.QuantizedLinear(64, 8, bias=False, group_size=64, bits=4)])


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4"])
def test_gdn_fused_projection_on_rows_is_the_batched_one(quantized):
    """The GDN layer hands its fused projection [T, H] rows (engine/models/gated_deltanet.py): each part
    is bitwise the part of the [1, T, H] call it replaced, squeezed."""
    rng = np.random.default_rng(1)
    if quantized:
        parts = [nn.QuantizedLinear(64, n, bias=False, group_size=32, bits=4) for n in (96, 32, 8, 8)]
    else:
        parts = [nn.Linear(64, n, bias=False) for n in (96, 32, 8, 8)]
    fused = FusedProjection(parts)
    for t in (1, 7):
        x = mx.array(rng.normal(size=(1, t, 64)).astype(np.float32))
        for got, want in zip(fused(x.reshape(t, -1)), fused(x), strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want.squeeze(0)))
