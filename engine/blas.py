"""Use a fast BLAS with MLX's Linux CPU wheel, with all its threads.

The `mlx-cpu` wheel bundles reference netlib BLAS: fp32 matmuls run ~40x slower than with
OpenBLAS. libmlx.so resolves cblas_sgemm dynamically, so preloading Debian's OpenBLAS
(`apt-get install libopenblas0-pthread`) takes it over. A preload only works from process
start, hence a re-exec. Must run before mlx is imported. Never imports mlx itself.

Ahead of OpenBLAS goes a small library of the engine's own (engine/gemv_shim.c, built once per user
with the C compiler on PATH) that computes products of 1 to 33 rows itself, on every core, reading
each weight once, each output summed in one order whatever the row count (so a decode step's row is
bitwise a verify row's): OpenBLAS 0.3.21 runs them all as full GEMMs that pack the whole weight
first, which made a decode step's and a verify's matmuls several times slower than they need be. It
also multiplies by bfloat16 copies of float32 weights whose values are bfloat16
(engine/half_weights.py): half the bytes a step reads, the same bits. Linked into the same library,
engine/exp2_shim.c answers libm's powf(2, y) with exp2f(y): the same bits at a third of the time,
for the CPU's exponentials (engine/cpu_exp.py). Without a compiler, or with SPRUCE_NO_GEMV_SHIM set,
OpenBLAS is preloaded alone.

With them goes jemalloc where it is installed (`apt-get install libjemalloc2`). MLX's CPU backend
allocates each operation's output on the thread that evaluates the graph and frees the inputs on
its stream's thread, and glibc's malloc makes the two meet on its arena lock at every operation. A
decode step of the bundled target is ~900 operations, most of them a few hundred floats, so that
cost is a good part of its step: with jemalloc an operation took 3.3-3.4 µs to build and evaluate
instead of 4.1-4.2 (an add; a view 1.2 instead of 1.5-1.6), and the bundled target decoded
1.05-1.14x faster (BENCHMARKS.md, "Plain decoding", thirty-first session; no difference on a
150 M-parameter model, whose step is bound by reading its weights). SPRUCE_NO_MALLOC_PRELOAD keeps
glibc's malloc.

OpenBLAS's threads can be set round by round (`pace`; off by default, see ADAPT_THREADS).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys
from pathlib import Path
from typing import Any

from engine import build_cache

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
ALLOCATORS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
)
OPT_OUT = "SPRUCE_NO_BLAS_PRELOAD"
MALLOC_OPT_OUT = "SPRUCE_NO_MALLOC_PRELOAD"
SHIM_OPT_OUT = "SPRUCE_NO_GEMV_SHIM"
SHIM_SOURCE = Path(__file__).with_name("gemv_shim.c")
# linked into the same library: powf(2, y) as exp2f(y), the same bits faster (engine/cpu_exp.py's
# exponentials)
SHIM_SOURCES = (SHIM_SOURCE, Path(__file__).with_name("exp2_shim.c"))
SHIM_NAME = "spruce-gemv-shim"  # the built library's file name starts with this
HINT = ("spruce: MLX uses a slow reference BLAS on Linux CPUs; "
        "`apt-get install libopenblas0-pthread libjemalloc2` makes it much faster")


def find_openblas() -> str | None:
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def find_allocator() -> str | None:
    """jemalloc's library where it is installed and not switched off (MALLOC_OPT_OUT), else None."""
    if os.environ.get(MALLOC_OPT_OUT):
        return None
    return next((p for p in ALLOCATORS if os.path.exists(p)), None)


def allocator_preloaded() -> bool:
    return any("jemalloc" in os.path.basename(p) for p in os.environ.get("LD_PRELOAD", "").split(":"))


def preloaded() -> bool:
    return any("openblas" in p for p in os.environ.get("LD_PRELOAD", "").split(":"))


def fast() -> bool:
    """Whether MLX's CPU matmuls run on a fast BLAS: OpenBLAS preloaded on Linux, Accelerate on macOS."""
    return preloaded() or platform.system() == "Darwin"


def reexec_with_openblas(argv: list[str]) -> str | None:
    """Re-exec `argv` with OpenBLAS preloaded when it helps (and with it jemalloc and the GEMV shim,
    where they are there). Returns a hint to print when it can't."""
    if platform.system() != "Linux" or os.environ.get(OPT_OUT) or preloaded() or "mlx.core" in sys.modules:
        return None
    lib = find_openblas()
    if lib is None:
        return HINT
    env = dict(os.environ)
    # the allocator first: it must be loaded before anything allocates
    allocator = None if allocator_preloaded() else find_allocator()
    env["LD_PRELOAD"] = ":".join(p for p in (allocator, gemv_shim(), lib, env.get("LD_PRELOAD", "")) if p)
    env[OPT_OUT] = "1"  # at most one re-exec, whatever happens
    os.execve(sys.executable, [sys.executable, *argv], env)
    return None  # not reached


# seconds the shim's build may take: gcc -O2 takes ~115 s over its vector code on the dev CPU (2
# cores, idle), longer under load. At 120 s a loaded CI run timed out, and the build then began
# again in the next directory.
SHIM_BUILD_TIMEOUT = 600


def gemv_shim() -> str | None:
    """The GEMV shim's library (engine/gemv_shim.c), compiled on first use into the user's cache
    (or the temporary directory) under a name that hashes its source; None where it is switched off
    or cannot be built. Building takes a C compiler (`$CC`, cc, gcc or clang) and, once per machine
    and source, about two minutes on the dev CPU (SHIM_BUILD_TIMEOUT)."""
    if os.environ.get(SHIM_OPT_OUT) or platform.system() != "Linux":
        return None
    try:
        source = b"".join(p.read_bytes() for p in SHIM_SOURCES)
    except OSError:
        return None
    name = f"{SHIM_NAME}-{hashlib.sha256(source).hexdigest()[:16]}-{platform.machine()}.so"
    found = build_cache.cached(name)
    if found is not None:
        return str(found)
    cc = build_cache.compiler("CC", ("cc", "gcc", "clang"))
    if cc is None:
        return None
    built = build_cache.build(name, lambda out: [cc, "-O2", "-shared", "-fPIC", "-o", str(out), *map(str, SHIM_SOURCES),
                                                 "-ldl", "-lm", "-pthread"], SHIM_BUILD_TIMEOUT)
    return None if built is None else str(built)


def _shim_handle() -> Any:
    """The shim this process has preloaded, or None. Never loads a library."""
    for path in os.environ.get("LD_PRELOAD", "").split(":"):
        if SHIM_NAME in os.path.basename(path):
            try:
                return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
            except OSError:
                return None
    return None


def _counter(symbol: str) -> int | None:
    """One of the shim's long counters (None: the shim is not loaded)."""
    handle = _shim_handle()
    return None if handle is None else int(ctypes.c_long.in_dll(handle, symbol).value)


def gemv_calls() -> int | None:
    """How many products the shim computed or sent to cblas_sgemv in this process (None: it is not
    loaded)."""
    return _counter("spruce_gemv_calls")


class ShimSetting:
    """One of the shim's int settings, read and written through ctypes: `value` is None where the
    shim is not loaded (and setting it then does nothing). Benchmarks set them to compare within one
    process (scripts/variants.py)."""

    def __init__(self, symbol: str) -> None:
        self.symbol = symbol

    def _cell(self) -> Any:
        handle = _shim_handle()
        return None if handle is None else ctypes.c_int.in_dll(handle, self.symbol)

    @property
    def value(self) -> int | None:
        cell = self._cell()
        return None if cell is None else int(cell.value)

    @value.setter
    def value(self, v: int | None) -> None:
        cell = self._cell()
        if cell is not None and v is not None:
            cell.value = int(v)


# The most rows a product may have to take the shim's small-row path (0: none do: one-row GEMVs
# and OpenBLAS, as before the path existed), and the threads that path may use (0: every core).
SMALL_ROWS = ShimSetting("spruce_small_rows")
GEMM_THREADS = ShimSetting("spruce_gemm_threads")
# Products by weights registered with engine/half_weights.py read their bfloat16 copies (1) or the
# float32 weights (0)
HALF = ShimSetting("spruce_half")
# powf(2, y) as exp2f(y) (engine/exp2_shim.c): 1 on, 0 off, 2 on and counted (pow2_calls); and
# whether its load-time check found the two the same (1) or not (-1: then it stays off)
POW2 = ShimSetting("spruce_pow2")
POW2_CHECKED = ShimSetting("spruce_pow2_checked")


def pow2_calls() -> int | None:
    """How many powf(2, y) the shim answered while POW2 was 2 (None: the shim is not loaded)."""
    return _counter("spruce_pow2_calls")


def half_calls() -> int | None:
    """How many products read a registered weight's half-width copy (None: the shim is not loaded)."""
    return _counter("spruce_half_calls")


# OpenBLAS's threads, by what the host does meanwhile. Plain rounds are pipelined: the host builds
# the next round's graph and lands the last one while MLX computes this one, and with OpenBLAS on
# every core those compete for the cores. `pace` gives such a round all threads but one, and
# everything the host waits for (a tree, drafting, prefill) all of them. Measured on the dev CPU (2
# cores) on a busy stretch of the machine, that made plain decoding of the bundled target 2-16 %
# faster (BENCHMARKS.md, issue 17, sixteenth session). On a quiet machine it is the other way, and
# more so the larger the model (`python scripts/bench_blas_threads.py`, twenty-first session, paced
# against all threads): the bundled target 0.99x / 0.87x (64 / 4000 prompt tokens); the bundled
# model widened (scripts/widen_checkpoint.py) 0.83x at hidden 512 and 0.66x at hidden 1024. So it
# is off by default: every matmul gets all threads. A product's rounding may move with the thread
# count as it does with the row count (4 rows of K = 256 equal one row's bitwise with two threads,
# not with one); neither way is a multi-row verify bitwise a one-row step on OpenBLAS. The lossless
# tests' failures once blamed on all threads (twenty-first session) did not come back in 70 runs
# of their file, nor in 500 random prompts (BENCHMARKS.md, issue 17, twenty-second session). Where
# OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set, that count is kept.
ADAPT_THREADS = False  # module switch (benchmarks compare; tests force it)
_THREADS: dict[str, Any] = {}  # the library handle ("lib", None where there is none), "all", "now"


def _openblas() -> Any:
    """The OpenBLAS this process has loaded (by the preload), or None. Never loads a library."""
    if "lib" not in _THREADS:
        fixed = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        lib = None if fixed or not preloaded() else next(filter(None, map(_loaded, _preloaded_openblas())), None)
        _THREADS["lib"] = lib
        if lib is not None:
            _THREADS["all"] = _THREADS["now"] = int(lib.openblas_get_num_threads())
    return _THREADS["lib"]


def _preloaded_openblas() -> list[str]:
    """Where the preloaded OpenBLAS may be: each preloaded path naming it, then the libopenblas.so.0
    beside it, for a preloaded name that does not export the thread calls itself."""
    paths = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "openblas" in p]
    return [c for p in paths for c in (p, os.path.join(os.path.dirname(p), "libopenblas.so.0"))]


def _loaded(path: str) -> Any:
    """The library at `path` if this process has it loaded and it sets OpenBLAS's threads, else None."""
    try:
        handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError:
        return None
    ok = hasattr(handle, "openblas_set_num_threads") and hasattr(handle, "openblas_get_num_threads")
    return handle if ok else None


def pace(host_busy: bool) -> None:
    """Set OpenBLAS's threads for the work queued next: all but one when the host goes on building
    graphs meanwhile (a pipelined one-node round), all otherwise. A no-op without OpenBLAS."""
    lib = _openblas() if ADAPT_THREADS else None
    if lib is None:
        return
    want = max(1, _THREADS["all"] - 1) if host_busy else _THREADS["all"]
    if want != _THREADS["now"]:
        lib.openblas_set_num_threads(want)
        _THREADS["now"] = want
