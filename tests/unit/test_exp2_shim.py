"""engine/exp2_shim.c: with the shim preloaded, MLX's powers of two (engine/cpu_exp.py's
exponentials, eager and compiled) reach its powf, and give the same bits as glibc's powf over a
wide sample of exponents; other bases are glibc's; SPRUCE_POW2=0 turns it off from the start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import blas

# Runs in a fresh process with the shim and OpenBLAS preloaded; prints JSON.
PROBE = r"""
import json
import mlx.core as mx
import numpy as np
from engine import blas, cpu_exp, cpu_ext

cpu_ext.SOFTMAX = False  # the softmax in MLX's operations (the engine's own op takes no powf)
report = {"checked": blas.POW2_CHECKED.value, "mode": blas.POW2.value}
# every 257th float bit pattern (all signs and exponents: 16.7 M exponents), then the ranges a
# softmax and the gates feed
bits = np.arange(0, 2**32, 257, dtype=np.uint64).astype(np.uint32)
wide = mx.array(bits.view(np.float32))
rng = np.random.default_rng(0)
scores = mx.array((rng.standard_normal((6, 4000)) * 6).astype(np.float32))
gates = mx.array((rng.standard_normal((3, 2048)) * 4).astype(np.float32))
cases = {
    "power, eager": lambda: mx.power(2.0, wide),
    "softmax_rows, compiled": lambda: cpu_exp.softmax_rows(scores),
    "silu": lambda: cpu_exp.silu(gates),
    "sigmoid": lambda: cpu_exp.sigmoid(gates),
    "logsumexp_rows": lambda: cpu_exp.logsumexp_rows(scores),
    "base 3": lambda: mx.power(3.0, gates),
}
outs = {}
for mode in (0, 1, 2):
    blas.POW2.value = mode
    before = blas.pow2_calls()
    outs[mode] = {name: np.array(run()) for name, run in cases.items()}
    report[f"calls {mode}"] = blas.pow2_calls() - before
def same_bits(a, b):  # every element the same float, NaN for NaN
    return bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())
report["same"] = {name: same_bits(outs[0][name], outs[1][name]) for name in cases}
report["base 3 error"] = float(np.abs(outs[1]["base 3"] - 3.0 ** np.array(gates, dtype=np.float64)).max()
                               / np.abs(3.0 ** np.array(gates, dtype=np.float64)).max())
print(json.dumps(report))
"""


def _probe(extra_env: dict[str, str]) -> dict:
    openblas = blas.find_openblas()
    if openblas is None or sys.platform != "linux":
        pytest.skip("OpenBLAS is not installed here")
    shim = blas.gemv_shim()
    if shim is None:
        pytest.skip("no C compiler to build the shim with")
    env = dict(os.environ, LD_PRELOAD=f"{shim}:{openblas}", SPRUCE_NO_BLAS_PRELOAD="1", **extra_env)
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_powers_of_two_take_exp2f_with_the_same_bits() -> None:
    report = _probe({})
    if report["checked"] != 1:
        pytest.skip("this libm's powf(2, y) and exp2f(y) differ: the shim leaves powf alone (as it should)")
    assert report["mode"] == 1
    assert all(report["same"].values()), report["same"]
    # counted only in mode 2, and then every exponential reaches the shim: 16.7 M powers, a softmax
    # and a log-sum-exp of 24,000, SiLU and sigmoid of 6,144 each; the base-3 power does not
    n = (2**32 + 256) // 257
    assert report["calls 0"] == 0 and report["calls 1"] == 0
    assert report["calls 2"] == n + 2 * 24000 + 2 * 6144, report
    assert report["base 3 error"] < 1e-6


def test_switched_off_from_the_start() -> None:
    report = _probe({"SPRUCE_POW2": "0"})
    assert report["mode"] == 0
    assert all(report["same"].values())
