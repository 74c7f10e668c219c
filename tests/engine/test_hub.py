"""Hugging Face repo ids without network: a cache laid out as huggingface_hub lays it out,
HF_HUB_OFFLINE=1 or a Hub that cannot be reached, and clear errors naming the repo and file."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine import hub
from engine.hub import HubError, RepoRef, parse_repo_ref
from engine.loader import load_model
from tests.helpers import add_to_hub_cache

COMMIT, OTHER = "a" * 40, "b" * 40


@pytest.mark.parametrize("text, ref", [
    ("Qwen/Qwen3.5-9B", RepoRef("Qwen/Qwen3.5-9B")),
    ("mlx-community/Qwen3.5-9B-4bit@main", RepoRef("mlx-community/Qwen3.5-9B-4bit", "main")),
    ("org/name@" + COMMIT, RepoRef("org/name", COMMIT)),
    ("org/name@refs/pr/3", RepoRef("org/name", "refs/pr/3")),
    ("justaname", None), ("/abs/path/model", None), ("a/b/c", None), ("org/name@", None), ("org/..", None),
    ("./model", None), ("~/models/x", None),
])
def test_parse_repo_ref(text, ref):
    assert parse_repo_ref(text) == ref


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, the Hub unreachable (a closed local port), offline mode off."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return cache


def _logits(path):
    model = load_model(path).model
    return np.array(model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), model.make_cache()))


def test_cached_repo_loads_offline(hub_cache, monkeypatch, tiny_qwen35):
    from huggingface_hub import constants

    snapshot = add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen35, COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = hub.resolve("org/tiny")
    assert source.path == snapshot and source.name == "org/tiny" and source.revision == COMMIT
    np.testing.assert_array_equal(_logits(source.path), _logits(tiny_qwen35))


def test_unreachable_hub_falls_back_to_the_cache(hub_cache, tiny_qwen35):
    add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen35, COMMIT)
    assert hub.resolve("org/tiny").revision == COMMIT


def test_revision_by_ref_and_by_commit(hub_cache, tiny_qwen35, tiny_qwen3):
    add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen35, COMMIT)
    add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen3, OTHER, ref="v2")
    assert hub.resolve("org/tiny@v2").revision == OTHER
    assert hub.resolve(f"org/tiny@{COMMIT}").revision == COMMIT
    assert json.loads((hub.resolve("org/tiny@v2").path / "config.json").read_text())["model_type"] == "qwen3"
    with pytest.raises(HubError, match="org/tiny@v3 is not in the local Hugging Face cache"):
        hub.resolve("org/tiny@v3")


def test_repo_not_cached_and_hub_unreachable(hub_cache):
    with pytest.raises(HubError, match=r"org/absent is not in the local Hugging Face cache \(.*\) and the Hub "
                                       r"cannot be reached"):
        hub.resolve("org/absent")


def test_missing_file_names_repo_and_file(hub_cache, monkeypatch, tiny_qwen35):
    from huggingface_hub import constants

    snapshot = add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen35, COMMIT)
    (snapshot / "tokenizer.json").unlink()
    with pytest.raises(HubError, match=r"org/tiny: tokenizer.json is missing from the local Hugging Face cache .* "
                                       r"the Hub cannot be reached"):
        hub.resolve("org/tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="org/tiny: tokenizer.json is missing .* HF_HUB_OFFLINE is set"):
        hub.resolve("org/tiny")


def test_sharded_snapshot_needs_every_shard(hub_cache, tmp_path, tiny_qwen35):
    src = tmp_path / "sharded"
    shutil.copytree(tiny_qwen35, src)
    weights = mx.load(str(src / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        mx.save_safetensors(str(src / fname), {k: weights[k] for k in keys})
    (src / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    snapshot = add_to_hub_cache(hub_cache, "org/sharded", src, COMMIT)
    np.testing.assert_array_equal(_logits(hub.resolve("org/sharded").path), _logits(tiny_qwen35))
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HubError, match="org/sharded: model-00002-of-00002.safetensors is missing"):
        hub.resolve("org/sharded")


def test_directories_win_and_bad_references_are_named(tmp_path):
    assert hub.resolve(str(tmp_path)).path == tmp_path
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(HubError, match="not a directory"):
        hub.resolve(str(tmp_path / "file.txt"))
    with pytest.raises(HubError, match="no such directory .*not a Hugging Face repo id"):
        hub.resolve(str(tmp_path / "a" / "b"))


def test_cached_models_lists_the_cache(hub_cache, tiny_qwen35):
    add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen35, COMMIT)
    (listed,) = hub.cached_models()
    assert listed.repo_id == "org/tiny" and listed.model_type == "qwen3_5_text" and listed.revisions == ("main",)
    assert listed.size_bytes > 0


def test_cli_settings_resolve_repo_ids_for_model_and_draft(hub_cache, monkeypatch, tiny_qwen35):
    import argparse

    from huggingface_hub import constants

    from server.cli_settings import SettingsError, engine_settings

    snapshot = add_to_hub_cache(hub_cache, "org/tiny", tiny_qwen35, COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    flags = dict(model="org/tiny", config=None, max_context=None, dtype=None, spec="draft", spec_budget=None,
                 spec_depth=None, draft_model="org/tiny@main", no_prefix_cache=False, prefix_cache_bytes=None)
    settings = engine_settings(argparse.Namespace(**flags))
    assert settings.config.model_path == str(snapshot) and settings.config.model_id == "org/tiny"
    assert settings.config.spec.draft_model == str(snapshot) and settings.config.dtype == "auto"
    with pytest.raises(SettingsError, match="--draft-model org/other is not in the local Hugging Face cache"):
        engine_settings(argparse.Namespace(**{**flags, "draft_model": "org/other"}))
