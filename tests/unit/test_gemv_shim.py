"""engine/gemv_shim.c: MLX's float32 products through the shim equal float64 NumPy's, for every
layout MLX hands cblas_sgemm, on both of its own kernels (x @ W.T and B stored [K, N]), the
GEMVs and OpenBLAS; a linear layer's rows are bitwise the same whatever the row count (2-33) and
the threads (batch invariance); the settings switch the paths; the shim is built once and found
again; switching it off leaves OpenBLAS alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import blas, build_cache

# Runs in a fresh process with the shim and OpenBLAS preloaded: MLX's products against float64
# NumPy, the rows' bitwise checks, and how many products the shim took, as JSON.
PROBE = r"""
import json
import mlx.core as mx
import numpy as np
from engine import blas

rng = np.random.default_rng(0)
def arr(*shape):
    return rng.standard_normal(shape).astype(np.float32)
f64 = lambda a: np.asarray(a, dtype=np.float64)

def relative(got, want):
    return float(np.abs(np.array(got, dtype=np.float64) - want).max() / max(1.0, np.abs(want).max()))

errors = {}
w, x, v = arr(300, 70), arr(1, 70), arr(300, 1)
q, k, c = arr(4, 1, 64), arr(4, 64, 33), arr(1, 300)
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
# both kernels across the tiles' edges: rows 1..40 (past the small-row limit of 33), widths that
# leave 1-3 columns past the 4-column tiles and 1-15 past the 16-column vectors, depths with a tail
# past the 16-float vectors and depths shorter than one
for m in (1, 2, 3, 5, 8, 13, 17, 33, 40):
    for n, kk in ((7, 5), (67, 37), (300, 96), (129, 16)):
        a, b, bias = arr(m, kk), arr(n, kk), arr(m, n)
        cases[f"dot {m}x{kk} @ {n}x{kk}.T"] = (lambda a=a, b=b: mx.array(a) @ mx.array(b).T, f64(a) @ f64(b).T)
        cases[f"outer {m}x{kk} @ {kk}x{n}"] = (lambda a=a, b=b: mx.array(a) @ mx.array(b.T.copy()),
                                               f64(a) @ f64(b).T)
        cases[f"outer, a transposed, {m}x{kk} @ {kk}x{n}"] = (
            lambda a=a, b=b: mx.array(a.T.copy()).T @ mx.array(b.T.copy()), f64(a) @ f64(b).T)
        cases[f"dot addmm {m}x{kk} @ {n}x{kk}.T"] = (
            lambda a=a, b=b, bias=bias: mx.addmm(mx.array(bias), mx.array(a), mx.array(b).T, alpha=0.5, beta=-1.5),
            -1.5 * f64(bias) + 0.5 * (f64(a) @ f64(b).T))
        cases[f"outer addmm {m}x{kk} @ {kk}x{n}"] = (
            lambda a=a, b=b, bias=bias: mx.addmm(mx.array(bias), mx.array(a), mx.array(b.T.copy()), alpha=2.0,
                                                 beta=0.25),
            0.25 * f64(bias) + 2.0 * (f64(a) @ f64(b).T))
# rows of A with a stride past their width (a slice of a wider array)
wide = arr(9, 200)
cases["strided rows @ w.T"] = (lambda: mx.array(wide)[:, 30:100] @ mx.array(w).T, f64(wide[:, 30:100]) @ f64(w).T)
cases["strided rows @ w"] = (lambda: mx.array(wide)[:, 30:100] @ mx.array(w.T.copy()),
                             f64(wide[:, 30:100]) @ f64(w).T)

calls0 = blas.gemv_calls()
for name, (run, want) in cases.items():
    errors[name] = relative(run(), want)
calls = {"all": blas.gemv_calls() - calls0}

# a linear layer's rows: bitwise the same at every row count from 2 to the limit (each row against
# the same row in a product of two), on every core or on one (the threads split the columns,
# never a sum)
w2 = mx.array(arr(1031, 384))
xs = mx.array(arr(1, 34, 384))
pairs = np.concatenate([np.array(xs[:, r : r + 2] @ w2.T) for r in range(0, 34, 2)], axis=1)
same = {}
for threads in (0, 1):
    blas.GEMM_THREADS.value = threads
    for m in (2, 3, 4, 5, 9, 16, 17, 33):
        whole = np.array(xs[:, :m] @ w2.T)
        same[f"{m} rows, threads {threads}"] = bool((whole == pairs[:, :m]).all())
blas.GEMM_THREADS.value = 0

# the setting: with the small-row path off, a 9-row product goes to OpenBLAS (not counted), and a
# 2-row one to two GEMVs (counted twice)
blas.SMALL_ROWS.value = 0
before = blas.gemv_calls()
errors["off: 9 rows"] = relative(mx.array(wide)[:, 30:100] @ mx.array(w).T, f64(wide[:, 30:100]) @ f64(w).T)
calls["off: 9 rows"] = blas.gemv_calls() - before
before = blas.gemv_calls()
errors["off: 2 rows"] = relative(mx.array(wide[:2, :70]) @ mx.array(w).T, f64(wide[:2, :70]) @ f64(w).T)
calls["off: 2 rows"] = blas.gemv_calls() - before
blas.SMALL_ROWS.value = 33

# the output of a product is fresh memory: left-over NaNs must not leak into it
for shape_x, shape_w in (((1, 300), (70, 300)), ((5, 300), (70, 300))):
    for _ in range(10):
        junk = mx.full((shape_x[0], 70), float("nan"))
        mx.eval(junk)
        del junk
        for out in (mx.array(arr(*shape_x)) @ mx.array(arr(*shape_w)).T,
                    mx.array(arr(*shape_x)) @ mx.array(arr(*shape_w).T.copy())):
            mx.eval(out)
            errors["nan"] = max(errors.get("nan", 0.0), float(np.isnan(np.array(out)).sum()))
print(json.dumps({"errors": errors, "same": same, "calls": calls}))
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


def _probe(threads: str | None) -> dict:
    openblas = _openblas_or_skip()
    shim = _shim_or_skip()
    env = dict(os.environ, LD_PRELOAD=f"{shim}:{openblas}", SPRUCE_NO_BLAS_PRELOAD="1")
    env.pop("SPRUCE_GEMM_THREADS", None)
    if threads is not None:
        env["SPRUCE_GEMM_THREADS"] = threads
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("threads", [None, "3"], ids=["every core", "three threads"])
def test_products_through_the_shim_equal_numpy_and_rows_are_batch_invariant(threads: str | None) -> None:
    report = _probe(threads)
    for name, error in report["errors"].items():
        assert error <= 1e-5, (name, error)
    assert all(report["same"].values()), report["same"]
    # every product the shim takes counts once, a product of one row as one GEMV: the fixed
    # cases' eight and the batched heads' four; 36 shapes x 5, of which the 40-row ones (4 x 5) go
    # to OpenBLAS; the two strided cases
    assert report["calls"]["all"] == 8 + 4 + 36 * 5 - 4 * 5 + 2
    assert report["calls"]["off: 9 rows"] == 0 and report["calls"]["off: 2 rows"] == 2


def test_built_once_and_found_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if sys.platform != "linux":
        pytest.skip("the shim is for Linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # the temporary directory's fallback too: a shim another process left in the machine's own
    # (a CI run found one there) would be found before this test's build
    monkeypatch.setattr(build_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
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
    monkeypatch.setattr(build_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(build_cache.shutil, "which", lambda name: None)
    assert blas.gemv_shim() is None  # nothing cached, nothing to build with: OpenBLAS alone


def test_not_loaded_means_no_count_and_no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    assert blas.gemv_calls() is None
    assert blas.SMALL_ROWS.value is None and blas.GEMM_THREADS.value is None
    blas.SMALL_ROWS.value = 3  # nothing to write to: ignored
    assert blas.SMALL_ROWS.value is None


def test_an_unwritable_cache_falls_back_to_the_next_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache directory that cannot be made (here: a file in its way) is skipped, not an error."""
    if sys.platform != "linux":
        pytest.skip("the shim is for Linux")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(build_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    shim = blas.gemv_shim()
    if shim is None and build_cache.shutil.which("cc") is None and build_cache.shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the shim with")
    assert shim is not None and Path(shim).parent == tmp_path / "tmp" / f"spruce-{os.getuid()}"


def test_a_build_out_of_time_is_not_begun_again_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler that runs out of time in one directory would in the next too: one try, then
    OpenBLAS alone (a loaded CI machine once paid the ~2 min build twice)."""
    if sys.platform != "linux":
        pytest.skip("the shim is for Linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(build_cache.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(build_cache.shutil, "which", lambda name: "/usr/bin/cc")
    calls = []

    def slow(cmd, **kwargs):
        calls.append(kwargs["timeout"])
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(build_cache.subprocess, "run", slow)
    assert blas.gemv_shim() is None
    assert calls == [blas.SHIM_BUILD_TIMEOUT]
