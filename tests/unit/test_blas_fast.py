"""engine.blas.fast: whether MLX's CPU matmuls run on a fast BLAS, which decides from how many
cached keys the CPU's one-row attention runs in ops (engine/models/layers.py)."""

from __future__ import annotations

import pytest

from engine import blas


@pytest.mark.parametrize(("system", "preload", "fast"), [
    ("Linux", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", True),
    ("Linux", "/opt/other/libjemalloc.so:/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", True),
    ("Linux", "", False),
    ("Linux", "/opt/other/libjemalloc.so", False),
    ("Darwin", "", True),  # Accelerate
])
def test_fast_blas(monkeypatch, system: str, preload: str, fast: bool) -> None:
    monkeypatch.setattr(blas.platform, "system", lambda: system)
    monkeypatch.setenv("LD_PRELOAD", preload)
    assert blas.fast() is fast
