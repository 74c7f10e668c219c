"""The quantized matmuls of the model's projections, chosen per backend and row count.

- CUDA: `quantized_matmul_mma` (metal/qmm_mma.kernel: tensor cores, each weight read once for up
  to 32 rows, a row's result the same whatever the row count), with fused builds that take in the
  norm before the product, the MLP's SwiGLU before it, or the residual add after it
  (engine/models/fused_qmm.py); from CUDA_DEQUANT_ROWS rows (prefill) dequantize + GEMM.
- CPU: MLX's quantized matmul for a few rows, dequantize + BLAS GEMM from CPU_DEQUANT_ROWS rows.
- `quantized_matmul_rows` (metal/qmm_rows.kernel, scalar FMAs, both GPU backends), `read_floor`
  and `read_stream`: the micro-benchmark's alternatives and yardsticks (scripts/bench_qmm.py).

`quantized_linear` is the entry the model's routed projections call (engine/models/qlinear.py).
"""

from __future__ import annotations

import mlx.core as mx

from engine.kernels import (
    QMM_MMA,
    QMM_MMA_NORM,
    QMM_MMA_RES,
    QMM_MMA_SWIGLU,
    QMM_MMA_SWIGLU_RES,
    QMM_ROWS,
    READ_FLOOR,
    READ_STREAM,
    compiled_kernel,
    eps_array,
    gpu_backend,
)

QMM_MAX_ROWS = 32
MMA_DTYPES = (mx.bfloat16, mx.float16)


def qmm_rows_for(m: int) -> tuple[int, int]:
    """(MAXM, R) for m activation rows: MAXM rounds m up to a power of two (few compiled
    variants); R output rows per SIMD group shrink as MAXM grows, so the registers stay bounded."""
    maxm = 1 << max(0, (m - 1).bit_length())
    return maxm, 8 if maxm <= 4 else 4 if maxm == 8 else 2


def quantized_matmul_rows(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                          bits: int, backend: str) -> mx.array:
    """x [M, I] @ dequantize(w)^T with the batch-invariant small-M kernel (metal/qmm_rows.kernel);
    shapes it does not cover go to mx.quantized_matmul."""
    m, i = x.shape
    o = w.shape[0]
    if m > QMM_MAX_ROWS or bits not in (4, 8) or i % (32 * (32 // bits)) or i % group_size:
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    maxm, r = qmm_rows_for(m)
    rpg = 4
    groups = -(-o // r)
    template = [("OutT", x.dtype), ("I", i), ("O", o), ("GS", group_size), ("BITS", bits), ("MAXM", maxm), ("R", r),
                ("RPG", rpg)]
    return compiled_kernel(QMM_ROWS, backend)(
        inputs=[x, w, scales, biases], template=template, grid=(groups * 32, 1, 1), threadgroup=(rpg * 32, 1, 1),
        output_shapes=[(m, o)], output_dtypes=[x.dtype])[0]


def mma_config(o: int, i: int, bits: int) -> tuple[int, int]:
    """(RT, KW) of qmm_mma for a weight [o x i]: 16-row tiles per warp and warps splitting the
    reduction. From the weight's shape only, never from the row count: a row's result must not
    depend on M. Measured on the H200 (scripts/bench_qmm.py --configs, 9B shapes, M = 1 and 17):
    one tile a warp and four warps a block were best or within 5 % of it on every shape; two
    tiles (fewer blocks) lost 20-35 % at M = 1. Long reductions (MMA_LONG_STEPS steps or more,
    the 9B down_proj's 12288 inputs) take MMA_LONG_KW warps: one warp walks fewer dependent steps."""
    steps = i // (16 * (32 // bits))
    if steps >= MMA_LONG_STEPS:
        return 1, max(4, min(MMA_LONG_KW, steps // 6))
    if o <= 16 * MMA_FEW_TILES:
        return 1, max(1, min(MMA_FEW_KW, steps))
    return 1, max(1, min(4, steps))


MMA_LONG_STEPS = 64  # 8192 inputs at 4 bits
# Warps a block for long reductions. H200, 9B shape, one process, runs interleaved
# (scripts/bench_gpu.py --cores kernels-kw4,kernels-kw16): plain decode 179.0 tok/s with 16
# against 148.4 with 4 (faster in 5 of 5 paired runs), 17-node round 12.65 ms against 14.16;
# the down_proj's 96 steps at one row: 6 dependent steps a warp instead of 24.
MMA_LONG_KW = 16
# Warps a block for weights of at most MMA_FEW_TILES 16-row tiles (one block each): the 9B's GDN
# out_proj (4096 x 4096, 256 blocks of 4 warps, 8 dependent steps a warp) reached 22 % of its read
# floor in a decode step under ncu, against ~50 % for the wider products (H100, BENCHMARKS.md,
# issue 13, forty-seventh session). More warps shorten each warp's walk where the blocks are too few
# to fill the GPU: one step under ncu, out_proj 11.7 -> 9.1 us with 8 warps, 8.7 with 16 (H100,
# forty-eighth session). Not 16: the norm build at 32 rows then asks more registers than a block of
# 512 threads has ("too many resources requested for launch", tests/kernels/test_qmm.py on the
# H100). scripts/variants.py's "-ksN" sets it; 4 was the rule before.
MMA_FEW_TILES = 256
MMA_FEW_KW = 8


def mma_covers(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
               bits: int) -> bool:
    """Whether qmm_mma computes x @ dequantize(w)^T (x already [M, I])."""
    m, i = x.shape
    return (1 <= m <= QMM_MAX_ROWS and bits in (4, 8) and group_size in (32, 64, 128) and biases is not None
            and x.dtype in MMA_DTYPES and scales.dtype == x.dtype and biases.dtype == x.dtype
            and i % (16 * (32 // bits)) == 0 and w.shape[1] * (32 // bits) == i)


# Paired dequantization in qmm_mma (DQ in metal/qmm_mma.kernel), for 4-bit weights: two weights
# a mask-and-or, a subtraction and an FMA in the activation type, instead of six fp32 instructions
# a weight. Rows stay bitwise equal whatever M is; the rounding differs from DQ = 0 (one bf16
# rounding of scale * q + bias instead of fp32 then bf16), within the twin's tolerance.
MMA_PAIRED_DEQUANT = True


# qmm_mma's builds by (norm before, SwiGLU before, residual add after)
MMA_BUILDS = {(False, False, False): QMM_MMA, (True, False, False): QMM_MMA_NORM, (False, False, True): QMM_MMA_RES,
              (False, True, False): QMM_MMA_SWIGLU, (False, True, True): QMM_MMA_SWIGLU_RES}


def quantized_matmul_mma(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                         bits: int, config: tuple[int, int] | None = None, paired: bool | None = None, *,
                         norm: tuple[mx.array, float] | None = None, swiglu: bool = False,
                         res: mx.array | None = None) -> mx.array:
    """x [M, I] @ dequantize(w)^T on CUDA tensor cores (metal/qmm_mma.kernel), batch-invariant;
    the caller checks mma_covers. config: (RT, KW), for the micro-benchmark's sweep; paired:
    MMA_PAIRED_DEQUANT unless given (4-bit weights only). The fused builds, one launch each:
    norm (weight [I], eps): rms_norm(x) * weight first; swiglu: x is gate | up [M, 2 I], silu(gate)
    * up first; res [M, O]: res + the product (MLX's rounding of that add), alone or after the
    SwiGLU."""
    spec = MMA_BUILDS.get((norm is not None, swiglu, res is not None))
    if spec is None:
        raise ValueError("qmm_mma has no build with both a norm and a SwiGLU, nor a norm and a residual add")
    m, i = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    o = w.shape[0]
    rt, kw = config or mma_config(o, i, bits)
    nt = -(-m // 8)
    blocks = -(-o // (16 * rt))
    dq = int(bits == 4 and (MMA_PAIRED_DEQUANT if paired is None else paired))
    template = [("OutT", x.dtype), ("GS", group_size), ("BITS", bits), ("NT", nt), ("RT", rt), ("KW", kw),
                ("DQ", dq)]
    inputs = [x, w, scales, biases, *(() if norm is None else (norm[0], eps_array(norm[1]))),
              *(() if res is None else (res,))]
    return compiled_kernel(spec, "cuda")(
        inputs=inputs, template=template, grid=(blocks * kw * 32, 1, 1), threadgroup=(kw * 32, 1, 1),
        output_shapes=[(m, o)], output_dtypes=[x.dtype])[0]


# From this many activation rows the CPU dequantizes the weight and runs a BLAS GEMM: MLX's CPU
# quantized matmul costs each row about what one row costs (512 rows: 32-60x dequantize + GEMM,
# OpenBLAS, fp32, dev CPU), while dequantizing costs about 2-9 rows' worth (the crossover measured
# at 4 rows for 1536 x 384 and 2048 x 2048, 9 rows for 5632 x 2048; 16 rows: 1.9-7.1x).
CPU_DEQUANT_ROWS = 9
# On CUDA the same from this many rows (a prefill chunk): MLX's quantized matmul for many rows
# runs far below the tensor cores' bf16 throughput, while dequantizing a weight costs one pass over
# it. Up to QMM_MAX_ROWS rows qmm_mma runs (decode, verify). H200, 9B shape 4-bit, 4k prompt:
# 8,295 tok/s against 5,443 with MLX's kernel at 512-token chunks, 13,359 against 6,396 at 2048
# (scripts/bench_prefill.py; BENCHMARKS.md, "prefill").
CUDA_DEQUANT_ROWS = 64
DEQUANT_BLOCK = 1 << 24  # weight elements dequantized at once (64 MiB in fp32): a big lm_head in slices
GPU_DEQUANT_BLOCK = 1 << 28  # on a GPU, whose memory is large: every 9B projection in one slice


def dequantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
                       bits: int, mode: str = "affine", block: int | None = None) -> mx.array:
    """x [..., I] @ dequantize(w)^T, the weight dequantized in slices of `block` elements (default
    DEQUANT_BLOCK) of output rows: each slice's copy is freed once its product exists, so memory
    grows by one slice, not the whole weight."""
    o, i = w.shape[0], x.shape[-1]
    step = max(1, (block or DEQUANT_BLOCK) // i)
    parts = []
    for start in range(0, o, step):
        rows = slice(start, min(start + step, o))
        dense = mx.dequantize(w[rows], scales[rows], None if biases is None else biases[rows], group_size=group_size,
                              bits=bits, mode=mode)
        parts.append(x @ dense.astype(x.dtype).T)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def as_rows(x: mx.array) -> mx.array:
    """x [..., I] as rows [M, I]; x itself where it is 2-D already: MLX makes a graph node of a
    reshape whose shape holds a -1 even when nothing changes, and every node is a step of the
    host's evaluation (on the H200 the host's encoding bounds a decode step)."""
    return x if x.ndim == 2 else x.reshape(-1, x.shape[-1])


def quantized_linear(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
                     bits: int, mode: str = "affine", routed: bool = True) -> mx.array:
    """x [..., I] @ dequantize(w)^T for the model's quantized projections, where the loader routes
    them (`routed`): on CUDA qmm_mma where it covers the call, dequantize + GEMM from
    CUDA_DEQUANT_ROWS rows on; on the CPU dequantize + GEMM from CPU_DEQUANT_ROWS rows on; else
    (and unrouted) mx.quantized_matmul."""
    if routed:
        backend = gpu_backend()
        rows = as_rows(x)
        if backend == "cuda" and mode == "affine" and biases is not None and mma_covers(rows, w, scales, biases,
                                                                                        group_size, bits):
            return quantized_matmul_mma(rows, w, scales, biases, group_size, bits).reshape(*x.shape[:-1], w.shape[0])
        if backend == "cuda" and rows.shape[0] >= CUDA_DEQUANT_ROWS:
            return dequantized_matmul(x, w, scales, biases, group_size, bits, mode, block=GPU_DEQUANT_BLOCK)
        if backend is None and rows.shape[0] >= CPU_DEQUANT_ROWS:
            return dequantized_matmul(x, w, scales, biases, group_size, bits, mode)
    return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, group_size=group_size, bits=bits,
                               mode=mode)


def read_floor(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, backend: str) -> mx.array:
    """Streams the packed weights once (the read floor of a matmul with them), launched like qmm_rows."""
    o, words = w.shape
    template = [("OutT", scales.dtype), ("WORDS", words), ("O", o), ("GS", group_size), ("BITS", bits), ("R", 8),
                ("RPG", 4)]
    return compiled_kernel(READ_FLOOR, backend)(
        inputs=[w, scales, biases], template=template, grid=(-(-o // 8) * 32, 1, 1), threadgroup=(128, 1, 1),
        output_shapes=[(o,)], output_dtypes=[mx.float32])[0]


def read_stream(w: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
    """Streams the packed weights, scales and biases once at the memory's streaming rate
    (CUDA, metal/read_stream.kernel): the honest read floor of a matmul with them."""
    threads = 256
    chunks = (w.nbytes + scales.nbytes + biases.nbytes) // 16
    blocks = max(1, min(2048, -(-chunks // (threads * 4))))
    return compiled_kernel(READ_STREAM, "cuda")(
        inputs=[w, scales, biases], template=[("OutT", scales.dtype)], grid=(blocks * threads, 1, 1),
        threadgroup=(threads, 1, 1), output_shapes=[(blocks * threads // 32,)], output_dtypes=[mx.uint32])[0]
