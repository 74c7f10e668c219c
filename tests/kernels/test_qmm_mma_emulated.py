"""qmm_mma (metal/qmm_mma.kernel, CUDA only) executed on the CPU by the lockstep SIMT emulation
(tests/kernels/emulate.py, emulate_simt: 32-lane warps, the tensor-core MMA computed from its
fragments), against mx.quantized_matmul and its fused builds' op twins, with the batch invariance
checked bitwise. The GPU run (test_qmm.py) checks the same on the hardware; this one runs in CI."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import kernels
from engine.kernels import QMM_MMA, QMM_MMA_NORM, QMM_MMA_RES, QMM_MMA_SWIGLU, QMM_MMA_SWIGLU_RES, KernelSpec
from engine.qmm import mma_config
from tests.kernels.emulate import SIMT_AVAILABLE, emulate_simt, from_bf16_bits, to_bf16_bits

pytestmark = pytest.mark.skipif(not SIMT_AVAILABLE, reason="the lockstep emulation needs g++ and Linux's ucontext")
EPS = 1e-6


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return to_bf16_bits(x)
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def from_bits(b: np.ndarray, dtype: str) -> np.ndarray:
    return from_bf16_bits(b) if dtype == "bfloat16" else b.view(np.float16).astype(np.float32)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to the activation type, as float32."""
    return from_bits(to_bits(x, dtype), dtype)


class Weight:
    """A random affine-quantized weight [o, i] with scales and biases in the activation type, and
    its dequantized float32 form (what the twin multiplies by)."""

    def __init__(self, rng: np.random.Generator, o: int, i: int, bits: int, group_size: int, dtype: str) -> None:
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        wq, scales, biases = mx.quantize(mx.array(rng.normal(size=(o, i)).astype(np.float32) * 0.05),
                                         group_size=group_size, bits=bits)
        self.w = np.array(wq).view(np.uint32)
        self.scales, self.biases = rounded(np.array(scales), dtype), rounded(np.array(biases), dtype)
        self.dense = np.array(mx.dequantize(wq, mx.array(self.scales), mx.array(self.biases), group_size=group_size,
                                            bits=bits))

    def run(self, spec: KernelSpec, x: np.ndarray, tmp, **extra: np.ndarray) -> np.ndarray:
        """The emulated kernel on float32 rows x (already in the activation type's values); extra
        inputs by name (nw, eps as float32; res as activation values) -> y as float32."""
        o = self.w.shape[0]
        m, i = x.shape[0], x.shape[1] // (2 if "SPR_SWIGLU_IN" in spec.defines else 1)
        rt, kw = mma_config(o, i, self.bits)
        template = dict(OutT=self.dtype, GS=self.group_size, BITS=self.bits, NT=-(-m // 8), RT=rt, KW=kw,
                        DQ=int(self.bits == 4))
        halves = {n: self.dtype for n in ("x", "scales", "biases", "res", "y")}
        inputs = {"x": to_bits(x, self.dtype), "w": self.w, "scales": to_bits(self.scales, self.dtype),
                  "biases": to_bits(self.biases, self.dtype)}
        for name, value in extra.items():
            inputs[name] = to_bits(value, self.dtype) if name == "res" else value.astype(np.float32)
        out = emulate_simt(spec, inputs, {"y": ((m, o), np.uint16)}, template, groups=-(-o // (16 * rt)),
                           threads=kw * 32, tmp=tmp, halves=halves)["y"]
        return from_bits(out, self.dtype)


def close(got: np.ndarray, twin: np.ndarray, dtype: str) -> None:
    """Within the activation type's rounding of the output (and of the weights' dequantization)."""
    tol = (2e-2 if dtype == "bfloat16" else 4e-3) * max(1.0, float(np.abs(twin).max()))
    assert float(np.abs(got - twin).max()) <= tol, (float(np.abs(got - twin).max()), tol)


# Row counts whose last tile takes each prologue path (SHARE_ROWS = 4 in qmm_mma.kernel): 1, 2 and
# 4 rows spread over the warp (one and two rounds), 5 rows one per lane; 9 rows (a full tile and a
# spread one) and the full 17 mix them.
PROLOGUE_ROWS = (1, 2, 4, 5, 9)


def invariant(run, x: np.ndarray, full: np.ndarray, rows=(1, 2, 9)) -> None:
    """The first m rows alone give bitwise the rows of the full launch: a verify row equals the
    one-row step."""
    for m in rows:
        assert np.array_equal(run(x[:m]), full[:m]), m


@pytest.mark.parametrize(("dtype", "bits", "o", "i"), [("bfloat16", 4, 528, 384), ("float16", 4, 64, 4096),
                                                       ("bfloat16", 8, 40, 1024), ("bfloat16", 4, 32, 8192)])
def test_mma_equals_quantized_matmul_and_is_batch_invariant(dtype, bits, o, i, rng, tmp_path):
    """The plain build. 8192 inputs at 4 bits take 10 warps a block (mma_config's long reductions)."""
    w = Weight(rng, o, i, bits, 64, dtype)
    x = rounded(rng.normal(size=(17, i)).astype(np.float32), dtype)
    full = w.run(QMM_MMA, x, tmp_path)
    close(full, x @ w.dense.T, dtype)
    invariant(lambda rows: w.run(QMM_MMA, rows, tmp_path), x, full)


@pytest.mark.parametrize(("dtype", "o", "i"), [("bfloat16", 528, 384), ("float16", 48, 2048)])
def test_norm_build_equals_norm_then_matmul(dtype, o, i, rng, tmp_path):
    w = Weight(rng, o, i, 4, 64, dtype)
    x = rounded(rng.normal(size=(17, i)).astype(np.float32) * 3.0, dtype)
    nw = (1.0 + 0.3 * rng.normal(size=i)).astype(np.float32)
    eps = np.array([EPS], dtype=np.float32)
    full = w.run(QMM_MMA_NORM, x, tmp_path, nw=nw, eps=eps)
    normed = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + EPS) * nw
    close(full, normed.astype(np.float32) @ w.dense.T, dtype)
    invariant(lambda rows: w.run(QMM_MMA_NORM, rows, tmp_path, nw=nw, eps=eps), x, full, PROLOGUE_ROWS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_swiglu_builds_equal_silu_times_up_then_matmul(dtype, rng, tmp_path):
    o, i = 96, 768
    w = Weight(rng, o, i, 4, 64, dtype)
    gate_up = rounded(rng.normal(size=(17, 2 * i)).astype(np.float32) * 2.0, dtype)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    act = rounded(rounded(gate * rounded(1.0 / (1.0 + np.exp(-gate)), dtype), dtype) * up, dtype)
    full = w.run(QMM_MMA_SWIGLU, gate_up, tmp_path)
    close(full, act @ w.dense.T, dtype)
    # against the plain build on those activations: the same MMAs, so only where NumPy's exp and
    # the C library's round an activation differently may they differ
    close(full, w.run(QMM_MMA, act, tmp_path), dtype)
    res = rounded(rng.normal(size=(17, o)).astype(np.float32), dtype)
    with_res = w.run(QMM_MMA_SWIGLU_RES, gate_up, tmp_path, res=res)
    assert np.array_equal(with_res, rounded(full + res, dtype))  # MLX's `res + y`, bitwise
    invariant(lambda rows: w.run(QMM_MMA_SWIGLU_RES, rows, tmp_path, res=res[: rows.shape[0]]), gate_up, with_res,
              PROLOGUE_ROWS)


def test_residual_build_adds_the_rounded_product(rng, tmp_path):
    dtype = "bfloat16"
    w = Weight(rng, 80, 512, 8, 128, dtype)
    x = rounded(rng.normal(size=(9, 512)).astype(np.float32), dtype)
    res = rounded(rng.normal(size=(9, 80)).astype(np.float32) * 4.0, dtype)
    plain = w.run(QMM_MMA, x, tmp_path)
    assert np.array_equal(w.run(QMM_MMA_RES, x, tmp_path, res=res), rounded(plain + res, dtype))


def test_a_wrong_fragment_mapping_fails(rng, tmp_path, monkeypatch):
    """The emulation computes what the body says: a body that stores each output in the wrong row
    of its tile is caught by the twin check."""
    original = kernels.read_source
    text = original("qmm_mma.kernel")
    assert "8u * uint(c / 2)" in text
    monkeypatch.setattr(kernels, "read_source", lambda f: text.replace("8u * uint(c / 2)", "0u * uint(c / 2)")
                        if f == "qmm_mma.kernel" else original(f))
    w = Weight(rng, 64, 384, 4, 64, "bfloat16")
    x = rounded(rng.normal(size=(3, 384)).astype(np.float32), "bfloat16")
    with pytest.raises(AssertionError):
        close(w.run(QMM_MMA, x, tmp_path), x @ w.dense.T, "bfloat16")
