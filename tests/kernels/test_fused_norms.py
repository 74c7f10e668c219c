"""The fused norms (metal/add_norm.kernel, metal/gated_norm.kernel) and the launch plans' own
kernels (the norm alone, SwiGLU, the attention's head norms and output gate) against their twins:
emulated on the CPU against NumPy (fp32), and on a GPU the MLX calls against the engine's ops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import engine.fused_norms as fused
from engine.fused_norms import (
    SWIGLU_THREADS,
    WPG,
    add_covers,
    add_norm,
    add_norm_threads,
    gated_covers,
    gated_norm,
    head_norms,
    heads_cover,
    rms_rows,
    rows_cover,
    sigmoid_gate,
    swiglu,
)
from engine.kernels import ADD_NORM, GATED_NORM, HEAD_NORMS, RMS_NORM, SIGMOID_GATE, SWIGLU, gpu_backend
from tests.kernels.emulate import SIMT_AVAILABLE, emulate, emulate_simt

EPS = np.array([1e-6], dtype=np.float32)


def rms(x: np.ndarray) -> np.ndarray:
    return np.sqrt((x.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize(("rows", "dims"), [(1, 384), (7, 384), (17, 100)])
def test_emulated_add_norm_equals_twin(rows, dims, rng, tmp_path):
    x = rng.normal(size=(1, rows, dims)).astype(np.float32)
    y = rng.normal(size=(1, rows, dims)).astype(np.float32)
    w = rng.normal(size=(dims,)).astype(np.float32)

    def run(a, b):
        n = a.shape[1]
        return emulate(ADD_NORM, {"x": a, "y": b, "w": w, "eps": EPS},
                       {"h": ((1, n, dims), np.float32), "out": ((1, n, dims), np.float32)},
                       {"OutT": "float32"}, n, 1, tmp_path)  # one thread a group: the emulation runs
        # threads one after another, so a threadgroup's barrier cannot hold there (the GPU tests cover it)

    got = run(x, y)
    h = x + y
    np.testing.assert_array_equal(got["h"], h)  # the add rounds once, as MLX's does
    want = h / rms(h) * w
    assert np.abs(got["out"] - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    one = run(x[:, :1], y[:, :1])  # a row's result does not depend on the launch's other rows
    np.testing.assert_array_equal(one["out"][0, 0], got["out"][0, 0])


@pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and Linux's ucontext")
@pytest.mark.parametrize(("rows", "dims"), [(1, 384), (5, 4096), (2, 8320)])
def test_lockstep_add_norm_with_its_threadgroups(rows, dims, rng, tmp_path):
    """The threadgroup a row as launched (96 / 1024 threads): SIMD sums across 32 lanes, then the
    groups' sums through threadgroup memory after the barrier. At 8,320 some threads have an
    element past the eight a thread keeps in registers."""
    x, y = (rng.normal(size=(1, rows, dims)).astype(np.float32) for _ in range(2))
    w = rng.normal(size=(dims,)).astype(np.float32)
    got = emulate_simt(ADD_NORM, {"x": x, "y": y, "w": w, "eps": EPS},
                       {"h": ((1, rows, dims), np.float32), "out": ((1, rows, dims), np.float32)},
                       {"OutT": "float32"}, rows, add_norm_threads(dims), tmp_path)
    h = x + y
    np.testing.assert_array_equal(got["h"], h)
    want = h / rms(h) * w
    assert np.abs(got["out"] - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and Linux's ucontext")
@pytest.mark.parametrize(("rows", "dims"), [(1, 384), (3, 4096)])
def test_lockstep_norm_alone_is_the_add_builds_norm_of_x_plus_zero(rows, dims, rng, tmp_path):
    """The launch plans' norm (SPR_NORM_ONLY, rows [M, Hd]) against a float64 twin, and bitwise the
    add build's norm with y = 0 (x + 0 rounds to x)."""
    x = rng.normal(size=(rows, dims)).astype(np.float32)
    w = rng.normal(size=(dims,)).astype(np.float32)
    threads = add_norm_threads(dims)
    got = emulate_simt(RMS_NORM, {"x": x, "w": w, "eps": EPS}, {"out": ((rows, dims), np.float32)},
                       {"OutT": "float32"}, rows, threads, tmp_path)["out"]
    want = x / rms(x) * w
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())
    added = emulate_simt(ADD_NORM, {"x": x[None], "y": np.zeros_like(x)[None], "w": w, "eps": EPS},
                         {"h": ((1, rows, dims), np.float32), "out": ((1, rows, dims), np.float32)},
                         {"OutT": "float32"}, rows, threads, tmp_path)["out"][0]
    np.testing.assert_array_equal(got, added)


@pytest.mark.parametrize(("rows", "width"), [(1, 96), (5, 384)])
def test_emulated_swiglu_equals_twin(rows, width, rng, tmp_path):
    gu = rng.normal(size=(rows, 2 * width)).astype(np.float32) * 3
    n = rows * width
    got = emulate(SWIGLU, {"gu": gu}, {"out": ((rows, width), np.float32)}, {"OutT": "float32"},
                  -(-n // SWIGLU_THREADS), SWIGLU_THREADS, tmp_path)["out"]
    g, u = gu[:, :width].astype(np.float64), gu[:, width:].astype(np.float64)
    want = g / (1.0 + np.exp(-g)) * u
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def emulate_head_norms(y: np.ndarray, qw: np.ndarray, kw: np.ndarray, heads: int, kv: int, tmp_path) -> dict:
    rows, width = y.shape
    d = width // (2 * heads + 2 * kv)
    return emulate_simt(HEAD_NORMS, {"y": y, "qw": qw, "kw": kw, "eps": EPS},
                        {"q": ((1, heads, rows, d), np.float32), "k": ((1, kv, rows, d), np.float32),
                         "v": ((1, kv, rows, d), np.float32), "gate": ((1, rows, heads * d), np.float32)},
                        {"OutT": "float32", "H": heads, "HKV": kv, "D": d}, -(-(rows * (heads + 2 * kv)) // WPG),
                        WPG * 32, tmp_path)


@pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and Linux's ucontext")
@pytest.mark.parametrize(("rows", "heads", "kv", "d"), [(1, 6, 2, 64), (5, 4, 1, 256), (3, 2, 2, 48)])
def test_lockstep_head_norms_equal_the_attentions_split_and_norms(rows, heads, kv, d, rng, tmp_path):
    """q | gate per head, then k, then v, as Qwen3.5's fused projection lays them out: q and k
    normed per head against float64, v and the gate copied bit for bit, each in the layout the
    next step reads; a row's results the same in a launch of one row."""
    y = rng.normal(size=(rows, (2 * heads + 2 * kv) * d)).astype(np.float32) * 2
    qw, kw = (rng.normal(size=(d,)).astype(np.float32) for _ in range(2))
    got = emulate_head_norms(y, qw, kw, heads, kv, tmp_path)
    qg = y[:, : 2 * heads * d].reshape(rows, heads, 2 * d)
    k = y[:, 2 * heads * d : (2 * heads + kv) * d].reshape(rows, kv, d)
    v = y[:, (2 * heads + kv) * d :].reshape(rows, kv, d)
    q = qg[..., :d].astype(np.float64)
    np.testing.assert_array_equal(got["gate"][0], qg[..., d:].reshape(rows, heads * d))
    np.testing.assert_array_equal(got["v"][0], v.transpose(1, 0, 2))
    for name, x, w in (("q", q, qw), ("k", k.astype(np.float64), kw)):
        want = (x / rms(x) * w).transpose(1, 0, 2)
        assert np.abs(got[name][0] - want).max() < 1e-5 * max(1.0, np.abs(want).max()), name
    one = emulate_head_norms(y[-1:], qw, kw, heads, kv, tmp_path)
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(one[name][0, :, 0], got[name][0, :, -1])
    np.testing.assert_array_equal(one["gate"][0, 0], got["gate"][0, -1])


@pytest.mark.parametrize(("rows", "width"), [(1, 96), (3, 1024)])
def test_emulated_sigmoid_gate_equals_twin(rows, width, rng, tmp_path):
    a = rng.normal(size=(rows, width)).astype(np.float32)
    g = rng.normal(size=(rows, width)).astype(np.float32) * 4
    n = rows * width
    got = emulate(SIGMOID_GATE, {"a": a, "g": g}, {"out": ((rows, width), np.float32)}, {"OutT": "float32"},
                  -(-n // SWIGLU_THREADS), SWIGLU_THREADS, tmp_path)["out"]
    want = a.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64)))
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize(("rows", "heads", "dv"), [(1, 12, 32), (9, 4, 128)])
def test_emulated_gated_norm_equals_twin(rows, heads, dv, rng, tmp_path):
    """z as the fused projection hands it over: a column slice of a wider row, read in place."""
    o = rng.normal(size=(rows, heads, dv)).astype(np.float32)
    wide = rng.normal(size=(rows, heads * dv + 40)).astype(np.float32)
    w = rng.normal(size=(dv,)).astype(np.float32)
    got = emulate(GATED_NORM, {"o": o, "z": wide, "w": w, "eps": EPS}, {"out": ((1, rows, heads * dv), np.float32)},
                  {"OutT": "float32"}, -(-(rows * heads) // WPG), WPG, tmp_path,
                  views={"z": (rows, heads * dv)})["out"]
    z = wide[:, : heads * dv].reshape(rows, heads, dv).astype(np.float64)
    want = (o / rms(o) * w) * (z / (1.0 + np.exp(-z)))
    assert np.abs(got.reshape(rows, heads, dv) - want).max() < 1e-5 * max(1.0, np.abs(want).max())


def test_heads_cover():
    y = mx.zeros((3, (2 * 4 + 2 * 2) * 32), dtype=mx.bfloat16)
    assert heads_cover(y, mx.ones((32,)), mx.ones((32,)), 4, 2)
    assert not heads_cover(y, mx.ones((32,)), mx.ones((32,)), 4, 1)  # 12 * 32 columns are not 10 heads' rows
    assert not heads_cover(y, mx.ones((64,)), mx.ones((32,)), 4, 2)
    assert not heads_cover(y[None], mx.ones((32,)), mx.ones((32,)), 4, 2)
    assert not heads_cover(y.astype(mx.int32), mx.ones((32,)), mx.ones((32,)), 4, 2)


def test_add_norm_threads_follow_the_row_width():
    assert [add_norm_threads(d) for d in (64, 100, 384, 4096, 5120, 8192)] == [32, 32, 96, 1024, 1024, 1024]


def test_covers():
    assert rows_cover(mx.zeros((3, 64), dtype=mx.bfloat16), mx.ones((64,)))
    assert not rows_cover(mx.zeros((1, 3, 64), dtype=mx.bfloat16), mx.ones((64,)))
    assert not rows_cover(mx.zeros((3, 64), dtype=mx.int32), mx.ones((64,)))
    x = mx.zeros((1, 3, 64), dtype=mx.bfloat16)
    assert add_covers(x, x, mx.ones((64,)))
    assert not add_covers(x, x.astype(mx.float32), mx.ones((64,)))
    assert not add_covers(mx.zeros((2, 3, 64)), mx.zeros((2, 3, 64)), mx.ones((64,)))
    assert not add_covers(x, x, mx.ones((32,)))
    o = mx.zeros((3, 4, 32))
    assert gated_covers(o, mx.zeros((3, 128), dtype=mx.bfloat16), mx.ones((32,)))
    assert not gated_covers(o.astype(mx.bfloat16), mx.zeros((3, 128), dtype=mx.bfloat16), mx.ones((32,)))
    assert not gated_covers(o, mx.zeros((3, 64), dtype=mx.bfloat16), mx.ones((32,)))


def test_off_by_default_and_without_a_gpu(monkeypatch):
    for switch in (fused.ADD, fused.GATED):
        monkeypatch.setattr(switch, "value", True)
        assert switch.enabled() == (gpu_backend() is not None)
        monkeypatch.setattr(switch, "value", False)
        assert not switch.enabled()


needs_gpu = pytest.mark.skipif(gpu_backend() is None, reason="the kernels run on a GPU backend")


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "dims"), [(1, 4096), (17, 4096), (5, 384)])
def test_gpu_add_norm_equals_add_and_rms_norm(dtype, rows, dims, rng):
    x = mx.array(rng.normal(size=(1, rows, dims)).astype(np.float32)).astype(dtype)
    y = mx.array(rng.normal(size=(1, rows, dims)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.normal(size=(dims,)).astype(np.float32)).astype(dtype)
    h, out = add_norm(x, y, w, 1e-6)
    assert mx.array_equal(h, x + y)
    want = mx.fast.rms_norm(x + y, w, 1e-6).astype(mx.float32)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(out.astype(mx.float32) - want).max()) <= tol * max(1.0, float(mx.abs(want).max()))


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "heads", "dv"), [(1, 32, 128), (17, 32, 128), (3, 12, 32)])
def test_gpu_gated_norm_equals_the_layers_norm(dtype, rows, heads, dv, rng):
    from engine.models.gated_deltanet import GatedRMSNorm

    norm = GatedRMSNorm(dv, 1e-6)
    norm.weight = mx.array(rng.normal(size=(dv,)).astype(np.float32)).astype(dtype)
    o = mx.array(rng.normal(size=(rows, heads, dv)).astype(np.float32))
    wide = mx.array(rng.normal(size=(rows, heads * dv + 64)).astype(np.float32)).astype(dtype)
    z = wide[:, : heads * dv]  # a slice, as the fused projection's output is split
    got = gated_norm(o, z, norm.weight, 1e-6).astype(mx.float32)
    want = norm(o, z.reshape(rows, heads, dv)).astype(dtype).reshape(1, rows, -1).astype(mx.float32)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(got - want).max()) <= tol * max(1.0, float(mx.abs(want).max()))


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "dims"), [(1, 4096), (17, 4096), (5, 384)])
def test_gpu_norm_alone_and_swiglu(dtype, rows, dims, rng):
    """The launch plans' norm against MLX's and bitwise add_norm's with y = 0; their SwiGLU against
    the ops; a row's result the same in a launch of one row."""
    x = mx.array(rng.normal(size=(rows, dims)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.normal(size=(dims,)).astype(np.float32)).astype(dtype)
    out = rms_rows(x, w, 1e-6)
    assert mx.array_equal(out[None], add_norm(x[None], mx.zeros_like(x)[None], w, 1e-6)[1])
    want = mx.fast.rms_norm(x, w, 1e-6).astype(mx.float32)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(out.astype(mx.float32) - want).max()) <= tol * max(1.0, float(mx.abs(want).max()))
    assert mx.array_equal(rms_rows(x[-1:], w, 1e-6), out[-1:])
    gu = mx.array(rng.normal(size=(rows, 2 * dims)).astype(np.float32) * 3).astype(dtype)
    got = swiglu(gu).astype(mx.float32)
    g, u = gu[:, :dims].astype(mx.float32), gu[:, dims:].astype(mx.float32)
    ref = (g * mx.sigmoid(g) * u)
    assert float(mx.abs(got - ref).max()) <= tol * max(1.0, float(mx.abs(ref).max()))
    assert mx.array_equal(swiglu(gu[-1:]), swiglu(gu)[-1:])


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "heads", "kv", "d"), [(1, 16, 4, 256), (17, 16, 4, 256), (3, 6, 2, 64)])
def test_gpu_head_norms_equal_the_attentions_projection_ops(dtype, rows, heads, kv, d, rng):
    """Against Attention.project's split, q_norm / k_norm (mx.fast.rms_norm) and transposes; v and
    the gate bit for bit; a row's results the same in a launch of one row."""
    y = mx.array(rng.normal(size=(rows, (2 * heads + 2 * kv) * d)).astype(np.float32)).astype(dtype)
    qw, kw = (mx.array(rng.normal(size=(d,)).astype(np.float32)).astype(dtype) for _ in range(2))
    q, k, v, gate = head_norms(y, qw, kw, 1e-6, heads, kv)
    qg = y[:, : 2 * heads * d].reshape(1, rows, heads, 2 * d)
    want_q = mx.fast.rms_norm(qg[..., :d], qw, 1e-6).transpose(0, 2, 1, 3)
    want_k = mx.fast.rms_norm(y[:, 2 * heads * d : (2 * heads + kv) * d].reshape(1, rows, kv, d), kw,
                              1e-6).transpose(0, 2, 1, 3)
    assert mx.array_equal(v, y[:, (2 * heads + kv) * d :].reshape(1, rows, kv, d).transpose(0, 2, 1, 3))
    assert mx.array_equal(gate, qg[..., d:].reshape(1, rows, heads * d))
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    for got, want in ((q, want_q), (k, want_k)):
        want = want.astype(mx.float32)
        assert float(mx.abs(got.astype(mx.float32) - want).max()) <= tol * max(1.0, float(mx.abs(want).max()))
    one = head_norms(y[-1:], qw, kw, 1e-6, heads, kv)
    for got, all_rows in zip(one[:3], (q, k, v), strict=True):
        assert mx.array_equal(got[:, :, 0], all_rows[:, :, -1])
    assert mx.array_equal(one[3][0, 0], gate[0, -1])


@needs_gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 4096), (17, 4096), (5, 384)])
def test_gpu_sigmoid_gate_equals_the_ops(dtype, rows, width, rng):
    a = mx.array(rng.normal(size=(rows, width)).astype(np.float32)).astype(dtype)
    g = mx.array(rng.normal(size=(rows, width)).astype(np.float32) * 3).astype(dtype)
    got = sigmoid_gate(a, g).astype(mx.float32)
    ref = a.astype(mx.float32) * mx.sigmoid(g.astype(mx.float32))
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(got - ref).max()) <= tol * max(1.0, float(mx.abs(ref).max()))
    assert mx.array_equal(sigmoid_gate(a[-1:], g[-1:]), sigmoid_gate(a, g)[-1:])
