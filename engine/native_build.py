"""Builds and loads the engine's C++ extensions of MLX (engine/cpu_ext.cpp, engine/cuda_ext.cpp).

Each is compiled on first use against the installed wheel's own headers and `libmlx.so`, with
nanobind's sources in MLX's nanobind domain ("mlx"), so its functions take and return mx.array.
Needs a C++20 compiler (`$CXX`, c++, g++ or clang++), Python's headers, MLX's headers and library
and the `nanobind` package (whose internals must match the version MLX was built with: a mismatch
shows at the extension's self-test). A build is cached per user under a name that hashes
everything that goes into it (engine/build_cache.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from engine import build_cache

log = logging.getLogger("spruce")

BUILD_TIMEOUT = 600  # seconds; an extension takes ~10-60 s


def inputs() -> tuple[Path, Path, Path] | None:
    """MLX's directory, nanobind's and Python's include directory; None where one is missing."""
    try:
        import nanobind
    except ImportError:
        return None
    mlx_dir = Path(mx.__file__).parent
    python_include = Path(sysconfig.get_paths()["include"])
    if not (mlx_dir / "include" / "mlx" / "mlx.h").is_file() or not (python_include / "Python.h").is_file():
        return None
    return mlx_dir, Path(nanobind.__file__).parent, python_include


def build(source: Path, name: str, flags: list[str], key: bytes = b"") -> Path | None:
    """The extension module `name` built from `source` with the compiler `flags` (beyond the
    common ones), from the cache where a build of the same inputs exists; None where it cannot be
    built. `key`: what else the build depends on (the CPU's features for -march=native)."""
    found = inputs()
    if found is None:
        return None
    mlx_dir, nb_dir, python_include = found
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    parts = [source.read_bytes(), str(getattr(mx, "__version__", "")).encode(), str(nb_dir).encode(),
             (nb_dir / "__init__.py").read_bytes(), suffix.encode(), " ".join(flags).encode(), key]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    filename = f"{name}-{digest}{suffix}"
    done = build_cache.cached(filename)
    if done is not None:
        return done
    cxx = build_cache.compiler("CXX", ("c++", "g++", "clang++"))
    if cxx is None:
        return None
    log.info("building the engine's %s (%s), once: ~10 s", name, source.name)
    return build_cache.build(filename, lambda out: [
        cxx, "-O3", *flags, "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx",
        f"-I{nb_dir / 'include'}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", f"-I{python_include}",
        f"-I{mlx_dir / 'include'}", "-o", str(out), str(source), str(nb_dir / "src" / "nb_combined.cpp"),
        f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}", "-ldl", "-pthread"], BUILD_TIMEOUT)


def load(path: Path, name: str) -> ModuleType | None:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def open_extension(source: Path, name: str, flags: list[str], self_test: Callable[[ModuleType], bool],
                   what: str, instead: str, key: bytes = b"") -> ModuleType | None:
    """The extension built (or found cached), loaded and passing `self_test`; None otherwise, said
    in the log once: `what` the extension serves ("the engine's CPU operations"), `instead` what
    runs without it ("MLX's operations run instead")."""
    path = build(source, name, flags, key)
    if path is None:
        log.info("%s are not built (no C++ compiler, Python or MLX headers, or nanobind); %s", what, instead)
        return None
    try:
        loaded = load(path, name)
        if loaded is not None and self_test(loaded):
            return loaded
    except (ImportError, TypeError, RuntimeError, ValueError) as e:
        log.warning("%s did not load (%s); %s", what, e, instead)
        return None
    log.warning("%s failed their self-test; %s", what, instead)
    return None


class Once:
    """An extension opened on first use, once (under a lock: the engine thread and a server's
    threads may ask together), then the same module or None every time."""

    def __init__(self, opener: Callable[[], ModuleType | None]) -> None:
        self._opener = opener
        self._lock = threading.Lock()
        self._done = False
        self._module: ModuleType | None = None

    def get(self) -> ModuleType | None:
        if not self._done:
            with self._lock:
                if not self._done:
                    self._module, self._done = self._opener(), True
        return self._module
