"""The CLI around models, as a user runs it: `spruce convert`, `spruce models`, `--model org/name`
from the Hugging Face cache without network, `--config` presets (flags win), `--spec auto`,
`--dtype`, and the memory lines of `spruce run`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import add_to_hub_cache

REPO = Path(__file__).resolve().parents[2]


def spruce(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, check=False, env=full_env)


@pytest.fixture
def hf_home(tmp_path, tiny_checkpoint):
    """HF_HOME with org/tiny cached (as huggingface_hub lays a cache out); the Hub unreachable."""
    home = tmp_path / "hf"
    add_to_hub_cache(home / "hub", "org/tiny", tiny_checkpoint, "c" * 40)
    return {"HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9"}


def test_run_from_the_hub_cache_offline(hf_home, tiny_checkpoint):
    by_dir = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", "--max-tokens", "6")
    offline = {**hf_home, "HF_HUB_OFFLINE": "1"}
    by_id = spruce("run", "--model", "org/tiny", "-m", "hi", "--max-tokens", "6", env=offline)
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == by_dir.stdout
    missing = spruce("run", "--model", "org/absent", "-m", "hi", env=offline)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    (line,) = missing.stderr.strip().splitlines()
    assert "org/absent is not in the local Hugging Face cache" in line and "HF_HUB_OFFLINE" in line


def test_models_lists_presets_and_cache(hf_home):
    p = spruce("models", env=hf_home)
    assert p.returncode == 0, p.stderr
    assert "bundled" in p.stdout and "qwen3.5-9b" in p.stdout and "qwen3.6-27b" in p.stdout
    assert "org/tiny" in p.stdout and "qwen3_5_text" in p.stdout and "main" in p.stdout


def test_convert_then_serve_the_output(tmp_path, tiny_checkpoint):
    out = tmp_path / "q8h"
    p = spruce("convert", str(tiny_checkpoint), str(out), "--bits", "8", "--group-size", "32", "--hadamard")
    assert p.returncode == 0, p.stderr
    assert "converting" in p.stderr and "quantized to 8-bit (group 32)" in p.stderr and "rotated" in p.stderr
    run = spruce("run", "--model", str(out), "-m", "hi", "--max-tokens", "4")
    assert run.returncode == 0, run.stderr
    again = spruce("convert", str(tiny_checkpoint), str(out))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_config_file_and_flags_that_override_it(tmp_path, tiny_checkpoint):
    preset = tmp_path / "mine.toml"
    preset.write_text(f'name = "mine"\ndescription = "test"\nmodel = "{tiny_checkpoint}"\nmax_context = 8\n'
                      'dtype = "bfloat16"\n[spec.cpu]\nmethod = "ngram"\nbudget = 4\ndepth = 2\nmeasured = true\n'
                      'speedup = 1.5\ntokens_per_forward = 2.0\nsource = "a test preset"\n')
    short = spruce("run", "--config", str(preset), "-m", "hi there, a prompt longer than eight tokens")
    assert short.returncode == 2 and "the context holds 8" in short.stderr
    p = spruce("run", "--config", str(preset), "--max-context", "512", "-m", "hi", "--max-tokens", "16")
    assert p.returncode == 0, p.stderr
    assert "speculation: ngram (--spec auto: measured 1.50x plain decoding on cpu for preset 'mine')" in p.stderr
    assert "weights: " in p.stderr and "(bfloat16)" in p.stderr and "caches: " in p.stderr
    off = spruce("run", "--config", str(preset), "--max-context", "512", "--spec", "none", "--dtype", "float32",
                 "-m", "hi", "--max-tokens", "4")
    assert off.returncode == 0 and "speculation:" not in off.stderr and "(float32)" in off.stderr
    unknown = spruce("run", "--config", "no-such-preset", "-m", "hi")
    assert unknown.returncode == 2 and "no preset named 'no-such-preset'" in unknown.stderr


def test_auto_without_a_preset_decodes_plainly_and_says_why(tiny_checkpoint):
    p = spruce("run", "--model", str(tiny_checkpoint), "-m", "hi", "--max-tokens", "4")
    assert p.returncode == 0, p.stderr
    assert "speculation: none (--spec auto: no preset describes this model" in p.stderr
