"""Session-wide fixtures: one tiny random checkpoint written by scripts/make_tiny_checkpoint.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _checkpoint_maker():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", REPO / "scripts" / "make_tiny_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny fp32 Qwen3.5 checkpoint (HF layout, byte-level BPE tokenizer, chat template)."""
    out = tmp_path_factory.mktemp("tiny_qwen35")
    _checkpoint_maker().main([str(out)])
    return out


def pytest_configure(config) -> None:
    """Re-run the test process with OpenBLAS preloaded (fp32 MLX matmuls ~40x faster on Linux)."""
    from engine.blas import reexec_with_openblas

    if not config.option.collectonly and not hasattr(config, "workerinput"):
        reexec_with_openblas(["-m", "pytest", *config.invocation_params.args])
