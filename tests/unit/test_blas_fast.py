"""engine.blas.fast: whether MLX's CPU matmuls run on a fast BLAS, which decides from how many
cached keys the CPU's one-row attention runs in ops (engine/models/layers.py)."""

from __future__ import annotations

from pathlib import Path

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


class FakeOpenBLAS:
    """Stands in for the library handle: records what the engine sets."""

    def __init__(self, threads: int) -> None:
        self.threads, self.calls = threads, []

    def openblas_get_num_threads(self) -> int:
        return self.threads

    def openblas_set_num_threads(self, n: int) -> None:
        self.calls.append(n)
        self.threads = n


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_pace_leaves_a_core_to_the_host_only_while_it_builds(monkeypatch, cores: int) -> None:
    """All threads but one while the host builds the next round (a pipelined one-node round), all
    of them otherwise; the library is called only when the count changes."""
    fake = FakeOpenBLAS(cores)
    monkeypatch.setattr(blas, "ADAPT_THREADS", True)
    monkeypatch.setattr(blas, "_THREADS", {"lib": fake, "all": cores, "now": cores})
    blas.pace(host_busy=True)
    assert fake.threads == max(1, cores - 1)
    blas.pace(host_busy=True)
    blas.pace(host_busy=False)
    assert fake.threads == cores
    blas.pace(host_busy=False)
    assert fake.calls == ([] if cores == 1 else [cores - 1, cores])
    monkeypatch.setattr(blas, "ADAPT_THREADS", False)
    blas.pace(host_busy=True)  # switched off: nothing is touched
    assert fake.threads == cores


def test_no_openblas_or_a_fixed_count_means_no_pacing(monkeypatch) -> None:
    monkeypatch.setattr(blas, "_THREADS", {})
    monkeypatch.setenv("LD_PRELOAD", "")
    assert blas._openblas() is None
    blas.pace(host_busy=True)  # a no-op, not an error
    monkeypatch.setattr(blas, "_THREADS", {})
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")  # the user's count is kept
    assert blas._openblas() is None


def test_pace_reaches_the_loaded_openblas(monkeypatch) -> None:
    """Where the test process runs with OpenBLAS preloaded (CI on Linux does), pace changes the
    count the library reports, and puts it back."""
    monkeypatch.setattr(blas, "_THREADS", {})
    monkeypatch.setattr(blas, "ADAPT_THREADS", True)  # off by default: this is what it does when on
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    lib = blas._openblas()
    if lib is None:
        pytest.skip("no OpenBLAS loaded in this process")
    every = blas._THREADS["all"]
    try:
        blas.pace(host_busy=True)
        assert lib.openblas_get_num_threads() == max(1, every - 1)
        blas.pace(host_busy=False)
        assert lib.openblas_get_num_threads() == every
    finally:
        lib.openblas_set_num_threads(every)



def _reexec_env(monkeypatch, tmp_path, allocator: bool, opt_out: bool, preload: str = "") -> dict[str, str]:
    """What reexec_with_openblas would exec with, on a Linux whose OpenBLAS (and jemalloc) exist."""
    openblas, jemalloc = tmp_path / "libblas.so.3", tmp_path / "libjemalloc.so.2"
    openblas.touch()
    if allocator:
        jemalloc.touch()
    monkeypatch.setattr(blas.platform, "system", lambda: "Linux")
    monkeypatch.setattr(blas, "CANDIDATES", (str(openblas),))
    monkeypatch.setattr(blas, "ALLOCATORS", (str(jemalloc),))
    monkeypatch.setattr(blas, "gemv_shim", lambda: None)
    monkeypatch.setattr(blas.sys, "modules", {k: v for k, v in blas.sys.modules.items() if k != "mlx.core"})
    for name in (blas.OPT_OUT, blas.MALLOC_OPT_OUT):
        monkeypatch.delenv(name, raising=False)
    if opt_out:
        monkeypatch.setenv(blas.MALLOC_OPT_OUT, "1")
    monkeypatch.setenv("LD_PRELOAD", preload)
    seen: dict[str, dict[str, str]] = {}

    def execve(path, argv, env):
        seen["env"] = env
        raise SystemExit(0)

    monkeypatch.setattr(blas.os, "execve", execve)
    with pytest.raises(SystemExit):
        blas.reexec_with_openblas(["x.py"])
    return seen["env"]


@pytest.mark.parametrize(("allocator", "opt_out", "preload", "first"), [
    (True, False, "", "libjemalloc.so.2"),  # the allocator goes first, ahead of OpenBLAS
    (True, True, "", "libblas.so.3"),  # switched off
    (False, False, "", "libblas.so.3"),  # not installed
    (True, False, "/opt/x/libjemalloc.so.2", "libblas.so.3"),  # the user's own: kept, not added twice
])
def test_reexec_preloads_jemalloc_where_installed(monkeypatch, tmp_path, allocator, opt_out, preload, first) -> None:
    env = _reexec_env(monkeypatch, tmp_path, allocator, opt_out, preload)
    paths = env["LD_PRELOAD"].split(":")
    assert paths[0].endswith(first)
    assert sum("jemalloc" in Path(p).name for p in paths) == (1 if (allocator and not opt_out) or preload else 0)
    assert any(p.endswith("libblas.so.3") for p in paths)
