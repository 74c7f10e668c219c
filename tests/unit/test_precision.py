"""TF32 off unless the user turns it on (engine/precision.py): on GPUs with matrix units MLX runs
float32 products of several rows at TF32 precision and a one-row step's in float32, so a verify
row would not compute what the plain step does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def tf32_seen(module: str, value: str | None) -> str:
    """MLX_ENABLE_TF32 as a fresh process sees it after importing `module`, started with `value`."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if value is not None:
        env["MLX_ENABLE_TF32"] = value
    code = f"import os, {module}; print(os.environ.get('MLX_ENABLE_TF32'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("module", ["engine", "engine.generate", "server.cli"])
def test_importing_the_engine_turns_tf32_off(module):
    assert tf32_seen(module, None) == "0"


@pytest.mark.parametrize("value", ["1", "0"])
def test_a_users_choice_is_kept(value):
    assert tf32_seen("engine", value) == value
