"""A residual add and the RMS norm after it in one GPU launch (metal/add_norm.kernel).

Why: on a GPU a step is bound by the host encoding its launches (BENCHMARKS.md, issue 12,
twenty-fourth session: ~10 µs of host time a launching operation on the H200), and every decoder
layer adds its mixer's output to the residual stream and normalises the sum before the MLP: two
launches, one here. Opt-in (SPRUCE_ADD_NORM=1) until measured: the emulated body matches its twin
on the CPU (tests/kernels/test_add_norm.py); the CUDA build has not run yet.
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels import ADD_NORM, OptIn, compiled_kernel, gpu_backend

WPG = 4  # rows (SIMD groups) a threadgroup
DTYPES = (mx.float32, mx.bfloat16, mx.float16)

# on with SPRUCE_ADD_NORM=1 on a GPU backend; benchmarks set SWITCH.value ("-an1", "-an0"). Read
# when a layer's compiled functions are traced: the layer keeps one trace per setting.
SWITCH = OptIn("SPRUCE_ADD_NORM")


def enabled() -> bool:
    return SWITCH.enabled()


def covers(x: mx.array, y: mx.array, w: mx.array) -> bool:
    """Rows [1, T, Hd] of one float dtype, and a norm weight [Hd]."""
    return (x.ndim == 3 and x.shape[0] == 1 and y.shape == x.shape and y.dtype == x.dtype and x.dtype in DTYPES
            and w.shape == (x.shape[2],) and w.dtype in DTYPES)


_EPS: dict[float, mx.array] = {}


def eps_array(eps: float) -> mx.array:
    """The norm's epsilon as an array, made once (a kernel takes no float arguments); built from
    host data, it holds its value already, so a compiled layer's trace can capture it."""
    if eps not in _EPS:
        _EPS[eps] = mx.array([eps], dtype=mx.float32)
    return _EPS[eps]


def add_norm(x: mx.array, y: mx.array, w: mx.array, eps: float,
             backend: str | None = None) -> tuple[mx.array, mx.array]:
    """(h, rms_norm(h) * w) with h = x + y, rows [1, T, Hd]; the caller checks covers()."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    T = x.shape[1]
    groups = -(-T // WPG)
    h, out = compiled_kernel(ADD_NORM, backend)(
        inputs=[x, y, w, eps_array(eps)], template=[("OutT", x.dtype)], grid=(groups * WPG * 32, 1, 1),
        threadgroup=(WPG * 32, 1, 1), output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, out
