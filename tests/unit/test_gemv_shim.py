"""engine/gemv_shim.c: MLX's float32 products of up to four rows (and of one column) sent to
cblas_sgemv equal the products themselves, for every layout MLX hands cblas_sgemm, and their rows
equal each row's product alone bitwise; the shim really takes them (and not the bigger ones); it is
built once and found again; switching it off leaves OpenBLAS alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import blas

# Runs in a fresh process with the shim and OpenBLAS preloaded: MLX's products against float64
# NumPy, then how many products the shim took, as JSON.
PROBE = r"""
import json
import mlx.core as mx
import numpy as np
from engine import blas

rng = np.random.default_rng(0)
def arr(*shape):
    return rng.standard_normal(shape).astype(np.float32)

errors, cases = {}, {}
w, x, v = arr(300, 70), arr(1, 70), arr(300, 1)
q, k, c = arr(4, 1, 64), arr(4, 64, 33), arr(1, 300)
f64 = lambda a: a.astype(np.float64)
cases = {  # name: (MLX's product, float64 NumPy's)
    "row @ w.T": (lambda: mx.array(x) @ mx.array(w).T, f64(x) @ f64(w).T),
    "row @ w": (lambda: mx.array(x) @ mx.array(w.T.copy()), f64(x) @ f64(w).T),
    "row viewed transposed @ w.T": (lambda: mx.array(x.T.copy()).T @ mx.array(w).T, f64(x) @ f64(w).T),
    "column.T @ w": (lambda: mx.array(v).T @ mx.array(w), f64(v).T @ f64(w)),
    "w.T @ column": (lambda: mx.array(w).T @ mx.array(v), f64(w).T @ f64(v)),
    "w @ row.T": (lambda: mx.array(w) @ mx.array(x).T, f64(w) @ f64(x).T),
    "one by one": (lambda: mx.array(x) @ mx.array(v[:70]), f64(x) @ f64(v[:70])),
    "batched heads": (lambda: mx.array(q) @ mx.array(k), f64(q) @ f64(k)),
    "addmm with beta": (lambda: mx.addmm(mx.array(c), mx.array(x), mx.array(w).T, alpha=0.5, beta=2.0),
                        2.0 * f64(c) + 0.5 * (f64(x) @ f64(w).T)),
}
for name, (run, want) in cases.items():
    got = np.array(run())
    errors[name] = float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))

# rows of products of up to GEMV_ROWS (4) rows: each bitwise the row alone (a GEMV a row)
w2 = mx.array(arr(257, 96))
same = {}
for m in (2, 3, 4, 9):
    xs = mx.array(arr(1, m, 96))
    whole = np.array(xs @ w2.T)
    alone = np.concatenate([np.array(xs[:, r : r + 1] @ w2.T) for r in range(m)], axis=1)
    same[m] = bool((whole == alone).all())
    errors[f"{m} rows"] = float(np.abs(whole - alone).max() / max(1.0, np.abs(whole).max()))

# the output of a product is fresh memory: left-over NaNs must not leak into it
for _ in range(20):
    junk = mx.full((1, 300), float("nan"))
    mx.eval(junk)
    del junk
    out = mx.array(x) @ mx.array(w).T
    mx.eval(out)
    errors.setdefault("nan", 0.0)
    errors["nan"] = max(errors["nan"], float(np.isnan(np.array(out)).sum()))
print(json.dumps({"errors": errors, "same": same, "calls": blas.gemv_calls()}))
"""


def _openblas_or_skip() -> str:
    lib = blas.find_openblas()
    if lib is None or sys.platform != "linux":
        pytest.skip("OpenBLAS is not installed here")
    return lib


def _shim_or_skip() -> str:
    shim = blas.gemv_shim()
    if shim is None:
        pytest.skip("no C compiler to build the shim with")
    return shim


def test_one_row_products_through_the_shim_equal_numpy(tmp_path: Path) -> None:
    openblas = _openblas_or_skip()
    shim = _shim_or_skip()
    env = dict(os.environ, LD_PRELOAD=f"{shim}:{openblas}", SPRUCE_NO_BLAS_PRELOAD="1")
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    for name, error in report["errors"].items():
        assert error <= 1e-5, (name, error)
    assert report["same"] == {"2": True, "3": True, "4": True, "9": report["same"]["9"]}
    # the eight one-row or one-column products, the batched heads' four, the rows of 2-4 row
    # products (whole and alone: 18), the 9-row products' single rows (9), the twenty NaN checks
    assert report["calls"] == 8 + 4 + 18 + 9 + 20


def test_built_once_and_found_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform != "linux":
        pytest.skip("the shim is for Linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = blas.gemv_shim()
    if first is None:
        pytest.skip("no C compiler to build the shim with")
    assert Path(first).parent == tmp_path / "spruce" and Path(first).is_file()
    stamp = Path(first).stat().st_mtime_ns
    assert blas.gemv_shim() == first and Path(first).stat().st_mtime_ns == stamp  # not rebuilt
    assert not list((tmp_path / "spruce").glob("*.part"))


def test_switched_off_or_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(blas.SHIM_OPT_OUT, "1")
    assert blas.gemv_shim() is None
    monkeypatch.delenv(blas.SHIM_OPT_OUT)
    monkeypatch.setattr(blas.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(blas.shutil, "which", lambda name: None)
    assert blas.gemv_shim() is None  # nothing cached, nothing to build with: OpenBLAS alone


def test_not_loaded_means_no_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    assert blas.gemv_calls() is None


def test_an_unwritable_cache_falls_back_to_the_next_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache directory that cannot be made (here: a file in its way) is skipped, not an error."""
    if sys.platform != "linux":
        pytest.skip("the shim is for Linux")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(blas.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    shim = blas.gemv_shim()
    if shim is None and blas.shutil.which("cc") is None and blas.shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the shim with")
    assert shim is not None and Path(shim).parent == tmp_path / "tmp" / f"spruce-{os.getuid()}"
