"""Helpers shared by the test packages: running a generation, the checkpoint maker, HF logits.

Imports nothing of MLX at module level: tests/conftest.py imports this before the test process
re-executes itself with OpenBLAS preloaded, which must happen before MLX loads.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.config import SamplingParams, SpecConfig
    from engine.drafters.base import Drafter
    from engine.generate import Engine
    from engine.types import Stats, TokenLogprob

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Generated:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: Stats | None = None
    finish_reason: str | None = None


def generate(engine: Engine, prompt: list[int], sampling: SamplingParams | None = None,
             spec: SpecConfig | None = None, drafter: Drafter | None = None,
             cancel_after: int | None = None) -> Generated:
    """Run one request to its end; cancel_after=i cancels it once step i has been read."""
    from engine.config import SamplingParams
    from engine.types import GenerationRequest

    req = GenerationRequest(prompt_ids=prompt, sampling=sampling or SamplingParams(), spec=spec)
    out = Generated()
    for i, step in enumerate(engine.generate(req, drafter=drafter)):
        out.tokens += step.token_ids
        out.logprobs += step.logprobs or []
        out.stats = step.stats or out.stats
        out.finish_reason = step.finish_reason or out.finish_reason
        if cancel_after is not None and i == cancel_after:
            req.cancel.set()
    return out


PARITY_SKIP = "needs the numerical references (torch, transformers, mlx-lm): pip install '.[parity]' (CI does)"


def parity_module(name: str) -> ModuleType:
    """Import a reference library of the parity extra, or skip the test that needs it."""
    import pytest

    return pytest.importorskip(name, reason=PARITY_SKIP)


@functools.cache
def checkpoint_maker() -> ModuleType:
    """scripts/make_tiny_checkpoint.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", REPO / "scripts" / "make_tiny_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_logits(path: Path | str, ids, conditional: bool = False) -> np.ndarray:
    """Logits [T, V] of HF transformers (PyTorch, CPU, fp32) for the token ids [T]."""
    import torch
    import transformers as tf

    cls = tf.Qwen3_5ForConditionalGeneration if conditional else tf.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(map(int, ids))])).logits[0].numpy()


def add_to_hub_cache(cache: Path, repo_id: str, src: Path, commit: str = "0" * 40, ref: str = "main") -> Path:
    """Lay `src`'s files out in a Hugging Face hub cache dir as huggingface_hub does (content-addressed
    blobs, a snapshot of symlinks per commit, refs/<ref> naming the commit). -> the snapshot dir."""
    import hashlib
    import os

    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.name
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def check_backend_default_switch(monkeypatch, switch: str, count: Callable[[], int],
                                 on: tuple[str, ...] = ("cuda",)) -> None:
    """An implementation the loader turns on by default on the backends `on` names
    (engine.kernels.backend_default): count() loads a model and says how many modules use it;
    `switch` (0 | 1) overrides the default, and another value is a CheckpointError naming it."""
    import pytest

    from engine.kernels import gpu_backend
    from engine.loader import CheckpointError

    monkeypatch.delenv(switch, raising=False)
    assert (count() > 0) == ((gpu_backend() or "cpu") in on)
    monkeypatch.setenv(switch, "1")
    assert count() > 0
    monkeypatch.setenv(switch, "0")
    assert count() == 0
    monkeypatch.setenv(switch, "on")
    with pytest.raises(CheckpointError, match=switch):
        count()
