"""Norms fused with what surrounds them, one GPU launch each instead of two:

- `add_norm` (metal/add_norm.kernel): a decoder layer's residual add and the RMS norm after it;
- `gated_norm` (metal/gated_norm.kernel): the Gated DeltaNet layer's output norm and its gate;

and the launch plans' own kernels for what the default wiring runs through MLX (engine/launch_plan.py:
a plan holds the engine's kernels only): `rms_rows` (the norm alone, add_norm.kernel's
SPR_NORM_ONLY build), `swiglu` (metal/swiglu.kernel), and the gated-attention layer's
`head_norms` (metal/head_norms.kernel: its q / k norms with v and the gate laid out for the next
steps) and `sigmoid_gate` (metal/sigmoid_gate.kernel).

Why: on a GPU a step is bound by the host encoding its launches (BENCHMARKS.md, issue 12,
twenty-fourth session: ~10 µs of host time a launching operation on the H200); at the 9B shape
these save 32 and 24 launches a step. Opt-in (SPRUCE_ADD_NORM=1, SPRUCE_GATED_NORM=1): their
twin tests pass on the CPU (emulated) and on the H200, but there they did not measurably shorten a
round (BENCHMARKS.md, issue 13, twenty-fifth session), and in bf16 they round differently from
MLX's norms (the order of the sum of squares; the product with the weight rounded once), which
changed one prompt's output of four from its 62nd token on. With the residual left pending (65
add_norm launches a 9B step) the first add_norm, one SIMD group a row, made the step device-bound:
118 tok/s against 224 without (BENCHMARKS.md, issue 13, twenty-ninth session). It now gives a row
a whole threadgroup: its twin tests pass on the H200 and the step is no longer device-bound there,
with no gain measured yet in the encoding.
"""

from __future__ import annotations

import mlx.core as mx

from engine import launch_plan
from engine.kernels import (
    ADD_NORM,
    GATED_NORM,
    HEAD_NORMS,
    RMS_NORM,
    SIGMOID_GATE,
    SWIGLU,
    FastPath,
    KernelSpec,
    compiled_kernel,
    eps_array,
    gpu_backend,
)

WPG = 4  # rows (SIMD groups) a threadgroup
DTYPES = (mx.float32, mx.bfloat16, mx.float16)

# on with SPRUCE_ADD_NORM=1 / SPRUCE_GATED_NORM=1 on a GPU backend; benchmarks set the values
# (scripts/variants.py's "-an1", "-gn1"). Read when a layer's compiled functions are traced: the
# layer keeps one trace per setting (traces()).
ADD = FastPath("SPRUCE_ADD_NORM")
GATED = FastPath("SPRUCE_GATED_NORM")


def traces() -> tuple[bool, bool]:
    """The settings a layer's compiled functions depend on; the gated norm on where launch plans are
    (engine/launch_plan.py), whose GDN layers run it."""
    return ADD.enabled(), GATED.enabled() or launch_plan.enabled()


def add_covers(x: mx.array, y: mx.array, w: mx.array) -> bool:
    """Rows [1, T, Hd] of one float dtype, and a norm weight [Hd]."""
    return (x.ndim == 3 and x.shape[0] == 1 and y.shape == x.shape and y.dtype == x.dtype and x.dtype in DTYPES
            and w.shape == (x.shape[2],) and w.dtype in DTYPES)


def add_norm(x: mx.array, y: mx.array, w: mx.array, eps: float,
             backend: str | None = None) -> tuple[mx.array, mx.array]:
    """(h, rms_norm(h) * w) with h = x + y, rows [1, T, Hd]; the caller checks add_covers()."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    T, Hd = x.shape[1], x.shape[2]
    threads = add_norm_threads(Hd)
    h, out = compiled_kernel(ADD_NORM, backend)(
        inputs=[x, y, w, eps_array(eps)], template=[("OutT", x.dtype)], grid=(T * threads, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
    return h, out


def rms_rows(x: mx.array, w: mx.array, eps: float, backend: str | None = None) -> mx.array:
    """rms_norm(x) * w for rows x [M, Hd], add_norm's arithmetic without the add (x + 0 rounds to
    x: the same bits as add_norm(x, 0)); the launch-plan wiring's norm (engine/launch_plan.py)."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    M, Hd = x.shape
    threads = add_norm_threads(Hd)
    return compiled_kernel(RMS_NORM, backend)(
        inputs=[x, w, eps_array(eps)], template=[("OutT", x.dtype)], grid=(M * threads, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def rows_cover(x: mx.array, w: mx.array) -> bool:
    """Rows [M, Hd] of a float dtype and a norm weight [Hd]: what rms_rows takes."""
    return x.ndim == 2 and x.dtype in DTYPES and w.shape == (x.shape[1],) and w.dtype in DTYPES


SWIGLU_THREADS = 256


def swiglu(gu: mx.array, backend: str | None = None) -> mx.array:
    """silu(gate) * up for rows gu = gate | up [M, 2 I] -> [M, I], in fp32, rounded once; the
    launch-plan wiring's SwiGLU (engine/launch_plan.py)."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    M, I2 = gu.shape
    return _elementwise(SWIGLU, backend, [gu], (M, I2 // 2))


def _elementwise(spec: KernelSpec, backend: str, inputs: list[mx.array], shape: tuple[int, int]) -> mx.array:
    """One launch of a kernel that writes one output element a thread, rows `shape` in the first
    input's dtype."""
    n = shape[0] * shape[1]
    return compiled_kernel(spec, backend)(
        inputs=inputs, template=[("OutT", inputs[0].dtype)], grid=(-(-n // SWIGLU_THREADS) * SWIGLU_THREADS, 1, 1),
        threadgroup=(SWIGLU_THREADS, 1, 1), output_shapes=[shape], output_dtypes=[inputs[0].dtype])[0]


def sigmoid_gate(a: mx.array, g: mx.array, backend: str | None = None) -> mx.array:
    """a * sigmoid(g) for rows a, g [M, N] -> [M, N], in fp32, rounded once: the gated-attention
    layer's output gate in the launch-plan wiring (engine/layer_plans.py)."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    return _elementwise(SIGMOID_GATE, backend, [a, g], (a.shape[0], a.shape[1]))


def head_norms(y: mx.array, qw: mx.array, kw: mx.array, eps: float, heads: int, kv_heads: int,
               backend: str | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The gated-attention layer's fused projection rows y [T, heads * 2 D + 2 kv_heads * D] (per
    query head [query | gate], then k, then v) -> (q [1, heads, T, D] and k [1, kv_heads, T, D]
    RMS-normed by qw / kw [D], v [1, kv_heads, T, D], gate [1, T, heads * D]); the caller checks
    heads_cover()."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    T, W = y.shape
    D = W // (2 * heads + 2 * kv_heads)
    groups = -(-(T * (heads + 2 * kv_heads)) // WPG)
    return tuple(compiled_kernel(HEAD_NORMS, backend)(  # type: ignore[return-value]
        inputs=[y, qw, kw, eps_array(eps)], template=[("OutT", y.dtype), ("H", heads), ("HKV", kv_heads), ("D", D)],
        grid=(groups * WPG * 32, 1, 1), threadgroup=(WPG * 32, 1, 1),
        output_shapes=[(1, heads, T, D), (1, kv_heads, T, D), (1, kv_heads, T, D), (1, T, heads * D)],
        output_dtypes=[y.dtype] * 4))


def heads_cover(y: mx.array, qw: mx.array, kw: mx.array, heads: int, kv_heads: int) -> bool:
    """Rows y [T, heads * 2 D + 2 kv_heads * D] of a float dtype and norm weights [D]: what
    head_norms takes."""
    if y.ndim != 2 or y.dtype not in DTYPES or y.shape[1] % (2 * heads + 2 * kv_heads):
        return False
    D = y.shape[1] // (2 * heads + 2 * kv_heads)
    return qw.shape == (D,) and kw.shape == (D,) and qw.dtype in DTYPES and kw.dtype in DTYPES


def add_norm_threads(Hd: int) -> int:
    """Threads of add_norm's threadgroup (one a row): about four elements a thread, whole SIMD
    groups, 32 to 1024. Set by the row's width alone, so a row sums in one order whatever T is."""
    return max(32, min(1024, -(-Hd // 4 // 32) * 32))


def gated_covers(o: mx.array, z: mx.array, w: mx.array) -> bool:
    """o [T, Hv, Dv] fp32, z [T, Hv * Dv] of a float dtype, a norm weight [Dv]."""
    return (o.ndim == 3 and o.dtype == mx.float32 and z.ndim == 2 and z.shape == (o.shape[0], o.shape[1] * o.shape[2])
            and z.dtype in DTYPES and w.shape == (o.shape[2],) and w.dtype in DTYPES)


def gated_norm(o: mx.array, z: mx.array, w: mx.array, eps: float, backend: str | None = None) -> mx.array:
    """rms_norm(o) * w * silu(z) per head row -> [1, T, Hv * Dv] in z's dtype; the caller checks
    gated_covers()."""
    backend = backend or gpu_backend()
    assert backend is not None, "a GPU kernel"
    T, Hv, _ = o.shape
    groups = -(-(T * Hv) // WPG)
    return compiled_kernel(GATED_NORM, backend)(
        inputs=[o, z, w, eps_array(eps)], template=[("OutT", z.dtype)], grid=(groups * WPG * 32, 1, 1),
        threadgroup=(WPG * 32, 1, 1), output_shapes=[(1, T, z.shape[1])], output_dtypes=[z.dtype])[0]
