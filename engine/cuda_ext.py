"""The engine's launch plans on CUDA (engine/cuda_ext.cpp), built on first use and loaded into MLX.

A plan is a fixed sequence of the engine's CUDA kernels run as one MLX operation
(engine/launch_plan.py makes them). The C++ file compiles each kernel with NVRTC, as MLX compiles
mx.fast.cuda_kernel's, and adds a plan's launches to MLX's CUDA graph itself when MLX evaluates it.
Building (engine/native_build.py) needs what the CPU extension needs, nothing of CUDA's toolkit:
NVRTC and the driver are found at run time in the libraries MLX's CUDA backend has loaded.

`module()` is None off CUDA, where it does not build or load, where its self-test fails, and with
SPRUCE_CUDA_EXT=0; plans are then not made and the callers launch kernel by kernel.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from types import ModuleType

import mlx.core as mx

from engine import native_build
from engine.kernels import gpu_backend

SOURCE = Path(__file__).with_name("cuda_ext.cpp")
NAME = "spruce_cuda_ext"
OPT_OUT = "SPRUCE_CUDA_EXT"  # "0": never built nor used


def module() -> ModuleType | None:
    """The loaded extension, built on first use; None where it cannot serve (said once in the log)."""
    return _once.get()


def _open() -> ModuleType | None:
    if os.environ.get(OPT_OUT, "1") == "0" or platform.system() != "Linux" or gpu_backend() != "cuda":
        return None
    # MLX's first GPU evaluation makes its device's primary context current on this thread, which
    # the kernels this extension compiles load into
    mx.eval(mx.zeros((1,)) + 1)
    return native_build.open_extension(SOURCE, NAME, [], _self_test, "the engine's launch plans",
                                       "kernels launch one by one")


_once = native_build.Once(_open)


def _self_test(ext: ModuleType) -> bool:
    """A two-launch plan (a kernel, then a second reading its result from the workspace) on a few
    numbers: what it checks is the path through MLX's encoder and buffers, which the build cannot."""
    from engine import launch_plan  # launch_plan imports this module

    return launch_plan.self_test(ext)
