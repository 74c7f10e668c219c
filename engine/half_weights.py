"""Half-width copies of float32 weights whose values are bfloat16, for the CPU's products.

A checkpoint stored in bfloat16 (the bundled models, Qwen3.5 releases) runs in float32 on the CPU,
so every weight value has 16 low bits that are zero, and a decode step, which reads every weight
once (on all but the smallest models, that reading is what it waits for), spends half of it on
those zeros. The GEMV shim (engine/gemv_shim.c) keeps a bfloat16 copy of each weight handed to it
here, after checking that every value is exactly a bfloat16, and computes products of 1 to 33 rows
by that weight from the copy, laid out in panels of 32 weight rows that its outer-product kernel
streams once for all the product's rows: the same floats once widened, half the bytes read
(plain decoding of the bundled target 1.2-1.4x faster on the dev CPU, of a 150 M-parameter model
1.5x: BENCHMARKS.md, fortieth session), and a verify of 7 rows about 2x cheaper in its products
than with the float32 kernel's tiles (forty-second session). Each output is summed in one order
whatever the row count, and one-row products by a registered weight take the kernel too (an
unregistered weight's go to OpenBLAS's GEMV), so a decode step's row and a verify's rows are
bitwise equal. The copies stop at MEMORY_SHARE of the machine's memory.

`register(owner, arrays)` registers the arrays for as long as `owner` lives: each array is kept
alive here meanwhile, so its address cannot be handed to another array while the shim still maps
it to the copy. Where the shim is not loaded (macOS, a GPU, SPRUCE_NO_GEMV_SHIM), or
SPRUCE_HALF_WEIGHTS=0, nothing is registered and products run as before. `blas.HALF` switches
the copies' use inside one process (benchmarks compare).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engine import blas
from engine.memory import physical_memory  # 0 where unknown: then nothing is registered

OPT_OUT = "SPRUCE_HALF_WEIGHTS"  # "0": keep every product on the float32 weights
# Smaller weights are not worth a slot of the shim's table (4,096 slots, half of them usable):
# their products are a few microseconds either way.
MIN_ELEMENTS = 16384
# The copies add half the float32 weights' memory again; they stop where they would take more than
# this share of the machine's memory (a bfloat16 Qwen3.5-4B in float32 on a 24 GB machine: 16 GB
# of weights fit, 8 GB of copies more would not), and the rest of the weights stay float32.
MEMORY_SHARE = 0.25

_LOCK = threading.Lock()
_HELD: dict[int, list[Any]] = {}  # address -> [the array, how many owners registered it]


def _library() -> Any:
    """The preloaded shim with the registration calls, where weights may be registered; else None."""
    if os.environ.get(OPT_OUT) == "0" or mx.default_device() != mx.cpu:
        return None
    handle = blas._shim_handle()
    if handle is None or not hasattr(handle, "spruce_half_add"):
        return None
    handle.spruce_half_add.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    handle.spruce_half_add.restype = ctypes.c_int
    handle.spruce_half_remove.argtypes = [ctypes.c_void_p]
    handle.spruce_half_remove.restype = ctypes.c_int
    return handle


def candidates_of(arrays: Iterable[Any]) -> list[mx.array]:
    """The float32 matrices among `arrays` large enough to register."""
    return [w for w in arrays
            if isinstance(w, mx.array) and w.ndim == 2 and w.dtype == mx.float32 and w.size >= MIN_ELEMENTS]


def candidates(module: nn.Module) -> list[mx.array]:
    """A module's float32 matrices large enough to register."""
    params = cast(list[tuple[str, mx.array]], tree_flatten(module.parameters()))
    return candidates_of(w for _, w in params)


def register(owner: object, arrays: Iterable[mx.array]) -> int:
    """Hand each row-contiguous float32 matrix of `arrays` large enough to be worth it and whose
    values are all bfloat16 to the shim, for as long as `owner` lives -> how many it took."""
    weakref.ref(owner)  # an owner that cannot be watched fails here (TypeError), before anything is registered
    lib = _library()
    if lib is None:
        return 0
    taken: list[int] = []
    room = MEMORY_SHARE * physical_memory()
    with _LOCK:
        room -= _copies_bytes()
        for w in candidates_of(arrays):
            if 2 * w.size > room:
                continue
            mx.eval(w)
            view = np.asarray(w)  # MLX's own buffer, no copy (the shim sees the same address)
            if not view.flags.c_contiguous:
                continue
            address = int(view.ctypes.data)
            rows, cols = int(view.shape[0]), int(view.shape[1])
            got = lib.spruce_half_add(address, rows, cols, cols)
            if got < 0:
                break  # the table or the memory is full: the rest stay float32
            if got == 1:
                entry = _HELD.setdefault(address, [w, 0])
                room -= 2 * w.size if entry[1] == 0 else 0
                entry[1] += 1
                taken.append(address)
    if taken:
        weakref.finalize(owner, _release, lib, taken).atexit = False
    return len(taken)


def register_module(module: nn.Module) -> int:
    """register() a module's float32 matrices for the module's lifetime."""
    return register(module, candidates(module))


def _release(lib: Any, addresses: list[int]) -> None:
    """The owner is gone: forget its arrays once no product by them can be running."""
    mx.synchronize()
    with _LOCK:
        for address in addresses:
            entry = _HELD.get(address)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                lib.spruce_half_remove(address)
                del _HELD[address]


def _copies_bytes() -> int:
    return sum(2 * w.size for w, _ in _HELD.values())


def copies_bytes() -> int:
    """The registered copies' bytes, all models together."""
    with _LOCK:
        return _copies_bytes()


def registered() -> int:
    """How many arrays are registered now (tests)."""
    with _LOCK:
        return len(_HELD)
