"""Loading streams the checkpoint one file at a time: a bf16 checkpoint computed in fp32 is never
held in memory twice (all files in bf16 plus all weights in fp32), and a checkpoint whose dtype is
the compute dtype is not copied at all."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.loader import KEEP_FP32, load_model

SHARDS = 4


@pytest.fixture(scope="module")
def sharded_bf16(tiny_qwen35, tmp_path_factory):
    """tiny_qwen35 stored in bf16 across 4 files of about equal size, with an HF index."""
    out = tmp_path_factory.mktemp("sharded_bf16")
    for f in tiny_qwen35.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    weights = mx.load(str(tiny_qwen35 / "model.safetensors"))
    files: list[dict[str, mx.array]] = [{} for _ in range(SHARDS)]
    sizes = [0] * SHARDS
    for name, w in sorted(weights.items(), key=lambda kv: -kv[1].size):
        i = sizes.index(min(sizes))
        files[i][name] = w.astype(mx.bfloat16)
        sizes[i] += w.size * 2
    weight_map = {}
    for i, shard in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        mx.save_safetensors(str(out / fname), shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out, sum(sizes), max(sizes)


def _peak_while_loading(path, dtype):
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    loaded = load_model(path, dtype)
    return loaded, mx.get_peak_memory() - base


def test_bf16_to_fp32_holds_at_most_one_file_twice(sharded_bf16):
    path, stored, largest = sharded_bf16
    loaded, peak = _peak_while_loading(path, "float32")
    assert loaded.nbytes == pytest.approx(2 * stored, rel=0.01)
    # all fp32 weights + the largest bf16 file (+ small temporaries): well below fp32 + all of bf16
    assert peak < loaded.nbytes + largest + stored / 8, (peak, loaded.nbytes, stored, largest)


def test_bf16_compute_keeps_bf16_weights(sharded_bf16):
    path, stored, _ = sharded_bf16
    loaded, peak = _peak_while_loading(path, "bfloat16")
    assert loaded.dtype == "bfloat16"
    dtypes = {name: v.dtype for name, v in tree_flatten(loaded.model.parameters())}
    # A_log and the gated norm's weight stay fp32 (engine.loader.KEEP_FP32); the rest stays bf16
    assert {d for n, d in dtypes.items() if not n.endswith(KEEP_FP32)} == {mx.bfloat16}
    assert {d for n, d in dtypes.items() if n.endswith(KEEP_FP32)} == {mx.float32}
    assert loaded.nbytes < stored * 1.05
    assert peak < stored * 1.3, (peak, stored)
