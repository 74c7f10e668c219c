"""Use a fast BLAS with MLX's Linux CPU wheel.

The `mlx-cpu` wheel bundles reference netlib BLAS: fp32 matmuls run ~40x slower than with
OpenBLAS. libmlx.so resolves cblas_sgemm dynamically, so preloading Debian's OpenBLAS
(`apt-get install libopenblas0-pthread`) takes it over. A preload only works from process
start, hence a re-exec. Must run before mlx is imported. Never imports mlx itself.
"""

from __future__ import annotations

import os
import platform
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
OPT_OUT = "SPRUCE_NO_BLAS_PRELOAD"
HINT = ("spruce: MLX uses a slow reference BLAS on Linux CPUs; "
        "`apt-get install libopenblas0-pthread` makes it much faster")


def find_openblas() -> str | None:
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def preloaded() -> bool:
    return any("openblas" in p for p in os.environ.get("LD_PRELOAD", "").split(":"))


def fast() -> bool:
    """Whether MLX's CPU matmuls run on a fast BLAS: OpenBLAS preloaded on Linux, Accelerate on macOS."""
    return preloaded() or platform.system() == "Darwin"


def reexec_with_openblas(argv: list[str]) -> str | None:
    """Re-exec `argv` with OpenBLAS preloaded when it helps. Returns a hint to print when it can't."""
    if platform.system() != "Linux" or os.environ.get(OPT_OUT) or preloaded() or "mlx.core" in sys.modules:
        return None
    lib = find_openblas()
    if lib is None:
        return HINT
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[OPT_OUT] = "1"  # at most one re-exec, whatever happens
    os.execve(sys.executable, [sys.executable, *argv], env)
    return None  # not reached
