"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh generator per test; set SPRUCE_TEST_SEED to replay a failure."""
    seed = int(os.environ.get("SPRUCE_TEST_SEED", secrets.randbits(32)))
    print(f"SPRUCE_TEST_SEED={seed}")  # pytest shows captured output of a failing test
    return np.random.default_rng(seed)
