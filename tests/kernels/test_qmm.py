"""The small-M quantized matmul (metal/qmm_rows.kernel) against mx.quantized_matmul, and its batch
invariance: a row's result is bitwise the same whatever the number of rows. Executed on the CPU
through the emulation (tests/kernels/emulate.py) everywhere g++ is, and on a GPU backend when
there is one."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest

from engine.kernels import QMM_ROWS, gpu_backend
from engine.qmm import qmm_rows_for, quantized_matmul_rows
from tests.kernels.emulate import emulate


def quantized(rng: np.random.Generator, out: int, inp: int, group_size: int, bits: int):
    w = mx.array(rng.normal(size=(out, inp)).astype(np.float32) * 0.05)
    return mx.quantize(w, group_size=group_size, bits=bits)


def run_emulated(x: np.ndarray, wq, group_size: int, bits: int, tmp) -> np.ndarray:
    w, scales, biases = (np.array(a) for a in wq)
    m, i = x.shape
    o = w.shape[0]
    maxm, r = qmm_rows_for(m)
    template = dict(OutT="float32", I=i, O=o, GS=group_size, BITS=bits, MAXM=maxm, R=r, RPG=1)
    inputs = {"x": x, "w": w.view(np.uint32), "scales": scales, "biases": biases}
    return emulate(QMM_ROWS, inputs, {"y": ((m, o), np.float32)}, template, groups=-(-o // r), threads=1,
                   tmp=tmp)["y"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (4, 128), (8, 64)])
def test_emulated_kernel_equals_twin_and_is_batch_invariant(bits, group_size, rng, tmp_path):
    o, i = 37, 512  # an output count that R does not divide: the tail rows are computed, not stored
    wq = quantized(rng, o, i, group_size, bits)
    x = rng.normal(size=(17, i)).astype(np.float32)
    ours = run_emulated(x, wq, group_size, bits, tmp_path)
    twin = np.array(mx.quantized_matmul(mx.array(x), *wq, transpose=True, group_size=group_size, bits=bits))
    assert np.abs(ours - twin).max() <= 1e-4 * max(1.0, np.abs(twin).max())
    for m in (1, 2, 5):  # the same rows alone: bitwise the same results
        assert np.array_equal(run_emulated(x[:m], wq, group_size, bits, tmp_path), ours[:m])


@pytest.mark.skipif(gpu_backend() is None, reason="needs a GPU backend (Metal or CUDA)")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (8, 128)])
@pytest.mark.parametrize(("out", "inp"), [(1030, 4096)])
def test_gpu_kernel_equals_twin_and_is_batch_invariant(dtype, bits, group_size, out, inp, rng):
    backend = gpu_backend()
    assert backend is not None
    wq = quantized(rng, out, inp, group_size, bits)
    x = mx.array(rng.normal(size=(32, inp)).astype(np.float32)).astype(dtype)
    full = quantized_matmul_rows(x, *wq, group_size, bits, backend)
    with mx.stream(mx.cpu):
        twin = mx.quantized_matmul(x.astype(mx.float32), *(a.astype(mx.float32) if a.dtype != mx.uint32 else a
                                                          for a in wq), transpose=True, group_size=group_size,
                                   bits=bits)
    scale = float(mx.abs(twin).max())
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert float(mx.abs(full.astype(mx.float32) - twin).max()) <= tol * max(1.0, scale)
    for m in (1, 2, 4, 8, 16, 17):
        part = quantized_matmul_rows(x[:m], *wq, group_size, bits, backend)
        assert mx.array_equal(part, full[:m]), m  # bitwise: a verify row equals the one-row step


needs_cuda = pytest.mark.skipif(gpu_backend() != "cuda", reason="qmm_mma is a CUDA kernel (PTX tensor-core MMA)")


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (4, 128), (8, 64), (8, 128)])
@pytest.mark.parametrize(("out", "inp"), [(1030, 4096), (4096, 12288), (528, 384)])
def test_mma_kernel_equals_twin_and_is_batch_invariant(dtype, bits, group_size, out, inp, rng):
    """Against mx.quantized_matmul in fp32 on the CPU (the kernel rounds the dequantized weights to
    the activations' type, as MLX's own GPU kernels do), and rows bitwise equal whatever M is."""
    check_mma_against_twin(dtype, bits, group_size, out, inp, rng)


@needs_cuda
@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (8, 64), (4, 128)])
def test_mma_long_reductions_with_sixteen_warps(bits, group_size, rng, monkeypatch):
    """The same with MMA_LONG_KW = 16 (the candidate for long reductions), on the 9B down_proj."""
    from engine import qmm

    monkeypatch.setattr(qmm, "MMA_LONG_KW", 16)
    assert qmm.mma_config(4096, 12288, bits)[1] == 16
    check_mma_against_twin(mx.bfloat16, bits, group_size, 4096, 12288, rng)


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(("out", "inp"), [(1030, 4096), (4096, 12288)])
def test_mma_kernel_without_paired_dequantization(dtype, out, inp, rng):
    """4-bit weights dequantized one by one in fp32 (DQ = 0, the form 8-bit weights always take)."""
    check_mma_against_twin(dtype, 4, 64, out, inp, rng, paired=False)


def check_mma_against_twin(dtype, bits, group_size, out, inp, rng, paired=None):
    from engine.qmm import mma_covers, quantized_matmul_mma

    w = mx.array(rng.normal(size=(out, inp)).astype(np.float32) * 0.05)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    x = mx.array(rng.normal(size=(32, inp)).astype(np.float32)).astype(dtype)
    assert mma_covers(x, wq, scales, biases, group_size, bits)
    full = quantized_matmul_mma(x, wq, scales, biases, group_size, bits, paired=paired)
    with mx.stream(mx.cpu):
        twin = mx.quantized_matmul(x.astype(mx.float32), wq, scales.astype(mx.float32), biases.astype(mx.float32),
                                   transpose=True, group_size=group_size, bits=bits)
    scale = float(mx.abs(twin).max())
    err = float(mx.abs(full.astype(mx.float32) - twin).max())
    assert err <= 2e-2 * max(1.0, scale), (err, scale)
    for m in (1, 2, 3, 4, 7, 8, 9, 16, 17, 24, 31):
        part = quantized_matmul_mma(x[:m], wq, scales, biases, group_size, bits, paired=paired)
        assert mx.array_equal(part, full[:m]), m  # bitwise: a verify row equals the one-row step


@needs_cuda
@pytest.mark.parametrize("config", [(1, 1), (1, 4), (2, 8), (4, 2), (1, 12), (1, 16)])
def test_mma_kernel_configs_agree(config, rng):
    """Every (tiles a warp, warps a block) computes the same product up to rounding: the config
    only changes the order of the sum."""
    from engine.qmm import quantized_matmul_mma

    wq, scales, biases = mx.quantize(mx.array(rng.normal(size=(1024, 2048)).astype(np.float32) * 0.05),
                                     group_size=64, bits=4)
    scales, biases = scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
    x = mx.array(rng.normal(size=(5, 2048)).astype(np.float32)).astype(mx.bfloat16)
    ref = quantized_matmul_mma(x, wq, scales, biases, 64, 4, (1, 1)).astype(mx.float32)
    got = quantized_matmul_mma(x, wq, scales, biases, 64, 4, config).astype(mx.float32)
    assert float(mx.abs(got - ref).max()) <= 1e-2 * max(1.0, float(mx.abs(ref).max()))


def test_mma_kernel_covers_only_what_it_computes():
    """fp32 activations, mismatched scale dtypes, other widths and more than 32 rows go to MLX."""
    from engine.qmm import mma_covers

    wq, scales, biases = mx.quantize(mx.zeros((64, 256)), group_size=64, bits=4)
    bf = scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
    assert mma_covers(mx.zeros((3, 256), dtype=mx.bfloat16), wq, *bf, 64, 4)
    assert not mma_covers(mx.zeros((3, 256)), wq, scales, biases, 64, 4)  # fp32
    assert not mma_covers(mx.zeros((33, 256), dtype=mx.bfloat16), wq, *bf, 64, 4)
    assert not mma_covers(mx.zeros((3, 256), dtype=mx.bfloat16), wq, scales, biases, 64, 4)  # fp32 scales
    w3, s3, b3 = mx.quantize(mx.zeros((64, 256)), group_size=64, bits=3)
    assert not mma_covers(mx.zeros((3, 256), dtype=mx.bfloat16), w3, s3.astype(mx.bfloat16),
                          b3.astype(mx.bfloat16), 64, 3)
    w4, s4, b4 = mx.quantize(mx.zeros((64, 320)), group_size=64, bits=4)  # 320 is not a multiple of 128
    assert not mma_covers(mx.zeros((3, 320), dtype=mx.bfloat16), w4, s4.astype(mx.bfloat16),
                          b4.astype(mx.bfloat16), 64, 4)


def test_mma_config_depends_on_the_weight_only():
    """Long reductions take MMA_LONG_KW warps (at least four), weights of at most MMA_FEW_TILES
    tiles MMA_FEW_KW, the rest at most four; never more warps than steps, and the choice never
    depends on the number of rows (the function does not take it)."""
    from engine import qmm

    assert qmm.mma_config(4096, 4096, 4) == (1, min(qmm.MMA_FEW_KW, 32))
    assert qmm.mma_config(1024, 1024, 4) == (1, min(qmm.MMA_FEW_KW, 8))
    assert qmm.mma_config(528, 384, 4) == (1, 3)
    assert qmm.mma_config(4112, 4096, 4) == (1, 4)  # 257 tiles: enough blocks
    assert qmm.mma_config(4096, 12288, 4)[1] == max(4, min(qmm.MMA_LONG_KW, 96 // 6))
    assert qmm.mma_config(4096, 12288, 8)[1] == max(4, min(qmm.MMA_LONG_KW, 192 // 6))


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(("out", "inp"), [(1030, 4096), (528, 384)])
def test_mma_fused_builds_equal_their_twins_and_are_batch_invariant(dtype, out, inp, rng):
    """The norm, SwiGLU and residual builds (engine/models/fused_qmm.py) against the ops they
    replace, computed in fp32 on the CPU, and rows bitwise equal whatever M is."""
    from engine.qmm import quantized_matmul_mma

    wq, scales, biases = mx.quantize(mx.array(rng.normal(size=(out, inp)).astype(np.float32) * 0.05),
                                     group_size=64, bits=4)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    x = mx.array(rng.normal(size=(32, inp)).astype(np.float32) * 2).astype(dtype)
    gate_up = mx.array(rng.normal(size=(32, 2 * inp)).astype(np.float32) * 2).astype(dtype)
    res = mx.array(rng.normal(size=(32, out)).astype(np.float32)).astype(dtype)
    nw = mx.array((1 + 0.3 * rng.normal(size=inp)).astype(np.float32))
    runs = {"norm": lambda m: quantized_matmul_mma(x[:m], wq, scales, biases, 64, 4, norm=(nw, 1e-6)),
            "swiglu_res": lambda m: quantized_matmul_mma(gate_up[:m], wq, scales, biases, 64, 4, swiglu=True,
                                                         res=res[:m]),
            "res": lambda m: quantized_matmul_mma(x[:m], wq, scales, biases, 64, 4, res=res[:m])}
    with mx.stream(mx.cpu):
        f32 = [a.astype(mx.float32) for a in (x, gate_up, res, scales, biases)]
        xf, gu, rf, sf, bf = f32

        def product(a: mx.array) -> mx.array:
            return mx.quantized_matmul(a, wq, sf, bf, transpose=True, group_size=64, bits=4)

        gate, up = gu[:, :inp], gu[:, inp:]
        twins = {"norm": product(mx.fast.rms_norm(xf, nw, 1e-6)),
                 "swiglu_res": rf + product(gate * mx.sigmoid(gate) * up), "res": rf + product(xf)}
    for name, run in runs.items():
        full = run(32)
        scale = max(1.0, float(mx.abs(twins[name]).max()))
        err = float(mx.abs(full.astype(mx.float32) - twins[name]).max())
        assert err <= 3e-2 * scale, (name, err, scale)
        for m in (1, 2, 4, 5, 7, 9, 17):  # the prologue's two paths (SHARE_ROWS) and mixes of them
            assert mx.array_equal(run(m), full[:m]), (name, m)
