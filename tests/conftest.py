"""Session fixtures: tiny random checkpoints written by HF transformers (the real format).

Each is made once per test session in a temp dir; tests never download anything. And `rng`, a
seeded generator for the tests that draw random inputs.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import checkpoint_maker, parity_module


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh generator per test; set SPRUCE_TEST_SEED to replay a failure."""
    seed = int(os.environ.get("SPRUCE_TEST_SEED", secrets.randbits(32)))
    print(f"SPRUCE_TEST_SEED={seed}")  # pytest shows captured output of a failing test
    return np.random.default_rng(seed)


def _make(tmp_path_factory, name: str, *args: str) -> Path:
    out = tmp_path_factory.mktemp(name)
    checkpoint_maker().main([str(out), *args])
    return out


@pytest.fixture(scope="session")
def tiny_qwen35(tmp_path_factory) -> Path:
    """Qwen3_5ForCausalLM, 4 layers (3 GDN + 1 attention), hidden 64, vocab 512, fp32."""
    return _make(tmp_path_factory, "tiny_qwen35", "--kind", "qwen3_5")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_qwen35) -> Path:
    """The default tiny checkpoint (server and CLI tests)."""
    return tiny_qwen35


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """A smaller random model with the tiny checkpoint's tokenizer: a draft model that disagrees often."""
    return _make(tmp_path_factory, "tiny_draft", "--kind", "qwen3_5", "--layers", "2", "--full-every", "2",
                 "--seed", "11")


@pytest.fixture(scope="session")
def tiny_qwen35_cg(tmp_path_factory) -> Path:
    """Qwen3_5ForConditionalGeneration layout (model.language_model.*, vision tensors), tied."""
    return _make(tmp_path_factory, "tiny_qwen35_cg", "--kind", "qwen3_5_cg", "--tied", "--seed", "3")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return _make(tmp_path_factory, "tiny_qwen3", "--kind", "qwen3", "--seed", "5")


def _copy(tmp_path_factory, src: Path, name: str) -> Path:
    out = tmp_path_factory.mktemp(name)
    shutil.copytree(src, out, dirs_exist_ok=True)
    return out


@pytest.fixture(scope="session")
def tiny_qwen35_mtp(tiny_qwen35, tmp_path_factory) -> Path:
    """The tiny target (same weights) with an MTP head in a separate mtp.safetensors."""
    parity_module("torch")  # the head is written by its PyTorch twin, for a config read by transformers
    parity_module("transformers")
    out = _copy(tmp_path_factory, tiny_qwen35, "tiny_qwen35_mtp")
    checkpoint_maker().add_mtp_to(out, 21, "file")
    return out


@pytest.fixture(scope="session")
def tiny_dflash(tiny_qwen35, tmp_path_factory) -> Path:
    """A random DFlash drafter for the tiny target, in z-lab's layout (2 layers, reads target layers 1,
    2), with a random Weaver adapter in weaver/ (converted from the published .pth format)."""
    parity_module("torch")  # the drafters are written by their PyTorch twins
    out = tmp_path_factory.mktemp("tiny_dflash")
    checkpoint_maker().make_dflash(out, tiny_qwen35, layers=2, seed=17)
    checkpoint_maker().make_weaver(out / "weaver", tiny_qwen35, seed=19)  # found there by default
    return out


@pytest.fixture(scope="session")
def tiny_qwen35_mlx(tiny_qwen35, tmp_path_factory) -> Path:
    """The same weights for mlx-lm, which reads model_type qwen3_5 (not HF's qwen3_5_text)."""
    out = tmp_path_factory.mktemp("tiny_qwen35_mlxsrc")
    shutil.copytree(tiny_qwen35, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["model_type"] = "qwen3_5"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def pytest_configure(config) -> None:
    """Re-run the test process with OpenBLAS preloaded (fp32 MLX matmuls ~40x faster on Linux)."""
    from engine.blas import reexec_with_openblas

    if not config.option.collectonly and not hasattr(config, "workerinput"):
        reexec_with_openblas(["-m", "pytest", *config.invocation_params.args])
