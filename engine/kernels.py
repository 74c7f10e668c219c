"""GPU kernels: loads the sources in metal/ once, compiles them for the backend MLX runs on, and
picks the implementation of the GDN recurrent core.

Each kernel body in metal/ is written once. For Metal it is compiled by mx.fast.metal_kernel,
for CUDA by mx.fast.cuda_kernel, each with a small prelude (metal/prelude_*.h) that maps the
SPR_* names to the backend, plus a first line that names the thread indices (MLX declares the
Metal index attributes a body mentions, so the Metal names must appear in the body itself).

Which core runs (SPRUCE_GDN_CORE overrides: ops | kernels):
- CPU: the plain-MLX OpsCore.
- CUDA: the kernels, verified against their twins on an H200 (metal/README.md).
- Metal: OpsCore unless SPRUCE_GDN_CORE=kernels: the Metal build of the bodies has only been
  compile-checked against a stub here, never run on an Apple GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from importlib import resources
from typing import Any

import mlx.core as mx

from engine.gdn import ops
from engine.gdn.core import GDNCore, GDNShape, GDNWeights, OpsCore, TreeInputs, TreeRows, split_heads
from engine.kernel_source import compact_source

BACKENDS = ("metal", "cuda")
SHARED_FLOATS = 8192  # 32 KiB of threadgroup memory: Apple GPUs' limit, under CUDA's static 48 KiB

INDEX_NAMES = {  # the thread indices every body uses
    "metal": ("const uint spr_group = threadgroup_position_in_grid.x;"
              " const uint spr_local = thread_position_in_threadgroup.x;"
              " const uint spr_threads = threads_per_threadgroup.x;"
              " const uint spr_ngroups = threadgroups_per_grid.x;"
              " const uint spr_lane = thread_index_in_simdgroup;"
              " const uint spr_warp = simdgroup_index_in_threadgroup;\n"),
    "cuda": ("const uint spr_group = blockIdx.x; const uint spr_local = threadIdx.x;"
             " const uint spr_threads = blockDim.x; const uint spr_ngroups = gridDim.x;"
             " const uint spr_lane = threadIdx.x % SPR_SIMD; const uint spr_warp = threadIdx.x / SPR_SIMD;\n"),
}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    header: tuple[str, ...] = ("gdn_common.h",)
    backends: tuple[str, ...] = BACKENDS  # qmm_mma is CUDA only (PTX tensor-core MMA)
    defines: tuple[str, ...] = ()  # macros set to 1 before the body: builds of one body with more inputs
    # MLX copies inputs that are not row-contiguous before the launch, unless the body reads them
    # through their strides (False: the attention kernels read the KV cache's slices in place)
    contiguous: bool = True


GDN_STEP = KernelSpec("spruce_gdn_step", "gdn_step.kernel",
                      ("qkv", "a", "b", "conv_state", "conv_w", "A_log", "dt_bias", "state"),
                      ("o", "conv_out", "state_out"))
GDN_TREE_FRONT = KernelSpec("spruce_gdn_tree_front", "gdn_tree_front.kernel",
                            ("qkv", "a", "b", "conv_state", "conv_w", "A_log", "dt_bias", "taps"),
                            ("q", "k", "v", "g", "beta"))
GDN_TREE = KernelSpec("spruce_gdn_tree", "gdn_tree.kernel", ("q", "k", "v", "g", "beta", "state", "order", "depth"),
                      ("o", "u"))
# the same two bodies with the last round's commit folded in (SPR_FOLD): see KernelCore.tree_after
GDN_TREE_FRONT_FOLD = KernelSpec("spruce_gdn_tree_front_fold", "gdn_tree_front.kernel",
                                 (*GDN_TREE_FRONT.inputs, "x_prev", "path"), (*GDN_TREE_FRONT.outputs, "conv_out"),
                                 defines=("SPR_FOLD",))
GDN_TREE_FOLD = KernelSpec("spruce_gdn_tree_fold", "gdn_tree.kernel",
                           (*GDN_TREE.inputs, "k_prev", "u_prev", "g_prev", "path"), (*GDN_TREE.outputs, "state_out"),
                           defines=("SPR_FOLD",))
GDN_CHAIN = KernelSpec("spruce_gdn_chain", "gdn_chain.kernel", ("q", "k", "v", "g", "beta", "state"),
                       ("o", "state_out"))
GDN_COMMIT = KernelSpec("spruce_gdn_commit", "gdn_commit.kernel",
                        ("x", "k", "u", "g", "path", "conv_state", "state"),
                        ("conv_out", "state_out"))
QMM_ROWS = KernelSpec("spruce_qmm_rows", "qmm_rows.kernel", ("x", "w", "scales", "biases"), ("y",), header=())
READ_FLOOR = KernelSpec("spruce_read_floor", "read_floor.kernel", ("w", "scales", "biases"), ("y",), header=())
READ_STREAM = KernelSpec("spruce_read_stream", "read_stream.kernel", ("w", "scales", "biases"), ("y",), header=(),
                         backends=("cuda",))
QMM_MMA = KernelSpec("spruce_qmm_mma", "qmm_mma.kernel", ("x", "w", "scales", "biases"), ("y",),
                     header=("qmm_mma_cuda.h",), backends=("cuda",))
# the same body with the RMS norm before it, the residual add after it, or the MLP's SwiGLU before
# and the residual add after (quantized_matmul_mma's norm, res, swiglu): launches a layer saves
QMM_MMA_NORM = KernelSpec("spruce_qmm_mma_norm", "qmm_mma.kernel", (*QMM_MMA.inputs, "nw", "eps"), ("y",),
                          header=QMM_MMA.header, backends=("cuda",), defines=("SPR_NORM_IN",))
QMM_MMA_RES = KernelSpec("spruce_qmm_mma_res", "qmm_mma.kernel", (*QMM_MMA.inputs, "res"), ("y",),
                         header=QMM_MMA.header, backends=("cuda",), defines=("SPR_RES_OUT",))
QMM_MMA_SWIGLU = KernelSpec("spruce_qmm_mma_swiglu", "qmm_mma.kernel", QMM_MMA.inputs, ("y",),
                            header=QMM_MMA.header, backends=("cuda",), defines=("SPR_SWIGLU_IN",))
QMM_MMA_SWIGLU_RES = KernelSpec("spruce_qmm_mma_swiglu_res", "qmm_mma.kernel", (*QMM_MMA.inputs, "res"), ("y",),
                                header=QMM_MMA.header, backends=("cuda",), defines=("SPR_SWIGLU_IN", "SPR_RES_OUT"))
# attention of decode and tree rows over the KV cache (engine/attention_rows.py): the chunks'
# partial softmaxes and their join, and the one-chunk build that writes the output itself
ATTN_ROWS = KernelSpec("spruce_attn_rows", "attn_rows.kernel", ("q", "keys", "values", "ancestors"),
                       ("part", "stats"), header=(), contiguous=False)
ATTN_ONE = KernelSpec("spruce_attn_one", "attn_rows.kernel", ATTN_ROWS.inputs, ("o",), header=(), contiguous=False,
                      defines=("SPR_ATTN_ONE",))
ATTN_MERGE = KernelSpec("spruce_attn_merge", "attn_merge.kernel", ("part", "stats"), ("o",), header=())
# a residual add and the RMS norm after it; the GDN output's norm and gate (engine/fused_norms.py)
ADD_NORM = KernelSpec("spruce_add_norm", "add_norm.kernel", ("x", "y", "w", "eps"), ("h", "out"), header=())
GATED_NORM = KernelSpec("spruce_gated_norm", "gated_norm.kernel", ("o", "z", "w", "eps"), ("out",), header=(),
                        contiguous=False)
KERNELS = (GDN_STEP, GDN_CHAIN, GDN_TREE_FRONT, GDN_TREE, GDN_TREE_FRONT_FOLD, GDN_TREE_FOLD, GDN_COMMIT, QMM_ROWS,
           READ_FLOOR, READ_STREAM, QMM_MMA, QMM_MMA_NORM, QMM_MMA_RES, QMM_MMA_SWIGLU, QMM_MMA_SWIGLU_RES,
           ATTN_ROWS, ATTN_ONE, ATTN_MERGE,
           ADD_NORM, GATED_NORM)
QMM_MAX_ROWS = 32
MMA_DTYPES = (mx.bfloat16, mx.float16)


def read_source(file: str) -> str:
    return resources.files("metal").joinpath(file).read_text()


def kernel_text(spec: KernelSpec, backend: str) -> tuple[str, str]:
    """(header, body) of a kernel for a backend, as handed to MLX (compacted: compact_source)."""
    header = "".join(read_source(f) for f in (f"prelude_{backend}.h", *spec.header))
    defines = "".join(f"#define {name} 1\n" for name in spec.defines)
    return compact_source(header), compact_source(INDEX_NAMES[backend] + defines + read_source(spec.file))


@functools.cache
def compiled_kernel(spec: KernelSpec, backend: str) -> Any:
    """The MLX kernel object, built once per process (each build is a new library)."""
    header, body = kernel_text(spec, backend)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(name=spec.name, input_names=list(spec.inputs), output_names=list(spec.outputs),
                source=body, header=header, ensure_row_contiguous=spec.contiguous)


def backend_default(switch: str, on: tuple[str, ...] = ("cuda",)) -> bool:
    """An implementation choice that is on by default on the backends `on` names ("cuda",
    "metal", "cpu"), where it was measured; the environment variable `switch` (0 | 1) overrides
    it. Raises ValueError on another value."""
    choice = os.environ.get(switch)
    if choice not in (None, "0", "1"):
        raise ValueError(f"{switch} must be 0 or 1, got {choice!r}")
    if choice is not None:
        return choice == "1"
    return (gpu_backend() or "cpu") in on


@dataclass
class FastPath:
    """A GPU fast path, on by default only on the GPU backends `on` names (where it was measured
    faster): `value` (True / False, set by benchmarks and tests) overrides the environment variable
    `env` (0 | 1), which overrides the default, read once a process; always off without a GPU
    backend."""

    env: str
    on: tuple[str, ...] = ()
    value: bool | None = None

    def enabled(self) -> bool:
        """Asked by every layer at every step: the cached choice first, the backend only when on."""
        on = self.value if self.value is not None else _env_choice(self.env, self.on)
        return on and gpu_backend() is not None


@functools.cache
def _env_choice(env: str, on: tuple[str, ...]) -> bool:
    return backend_default(env, on=on)


def gpu_backend() -> str | None:
    if mx.default_device() == mx.cpu:
        return None
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else None


class KernelCore(OpsCore):
    """The GDN core on GPU kernels; shapes the kernels do not cover run the plain ops."""

    def __init__(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"kernel backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.name = f"kernels-{backend}"

    @staticmethod
    def covers(shape: GDNShape) -> bool:
        return shape.Dk % 32 == 0 and shape.Dk <= 256 and shape.Hv % shape.Hk == 0

    def _launch(self, spec: KernelSpec, shape: GDNShape, inputs: list[mx.array],
                outputs: list[tuple[tuple[int, ...], mx.Dtype]], rows_per_group: int, rows: int = 0,
                **extra: int) -> list[mx.array]:
        """One SIMD group per row: `rows` of them (default: the state's Hv * Dv rows)."""
        s = shape
        template = [("Hk", s.Hk), ("Hv", s.Hv), ("Dk", s.Dk), ("Dv", s.Dv), ("K", s.K), ("RPG", rows_per_group),
                    *extra.items()]
        groups = -(-(rows or s.Hv * s.Dv) // rows_per_group)
        return compiled_kernel(spec, self.backend)(
            inputs=inputs, template=template, grid=(groups * rows_per_group * 32, 1, 1),
            threadgroup=(rows_per_group * 32, 1, 1),
            output_shapes=[o[0] for o in outputs], output_dtypes=[o[1] for o in outputs])

    @staticmethod
    def _rows_per_group(shape: GDNShape, most: int) -> int:
        rpg = most
        while shape.Dv % rpg:
            rpg //= 2
        return rpg

    def step(self, shape, w, qkv, a, b, conv_state, S):
        if not self.covers(shape) or qkv.dtype != conv_state.dtype:
            return super().step(shape, w, qkv, a, b, conv_state, S)
        o, conv, S = self._launch(
            GDN_STEP, shape, [qkv, a, b, conv_state, w.conv, w.A_log, w.dt_bias, S],
            [((shape.Hv, shape.Dv), mx.float32), (tuple(conv_state.shape), conv_state.dtype),
             (tuple(S.shape), mx.float32)], self._rows_per_group(shape, 4))
        return o[None], conv, S

    def chain(self, shape, w, qkv, a, b, conv_state, S):
        if qkv.shape[0] == 1:
            return self.step(shape, w, qkv, a, b, conv_state, S)
        if not self.covers(shape):
            return super().chain(shape, w, qkv, a, b, conv_state, S)
        # the front for all rows at once in ops, the recurrence token after token in the kernel:
        # on the GPU the chunked dense form costs 50x more (26.6 ms a 9B layer for 512 rows, H200)
        g, beta = ops.gates(a, b, w.A_log, w.dt_bias)
        y, conv_state = ops.causal_conv(qkv, conv_state, w.conv)
        q, k, v = split_heads(shape, y)
        n, s = qkv.shape[0], shape
        o, S = self._launch(GDN_CHAIN, shape, [q, k, v, g, beta, S],
                            [((n, s.Hv, s.Dv), mx.float32), (tuple(S.shape), mx.float32)],
                            self._rows_per_group(shape, 4))
        return o, conv_state, S

    def tree(self, shape, w, qkv, a, b, conv_state, S0, tree: TreeInputs):
        levels = tree.levels
        if not self.covers(shape) or levels * shape.Dk > SHARED_FLOATS:
            return super().tree(shape, w, qkv, a, b, conv_state, S0, tree)
        # two launches: the front of every node at once, then the recurrence node by node
        # (measured on the H200: the front in ops cost ~140 us a 9B layer at 17 nodes; fused into
        # the recurrence, where each state row walks the nodes in turn, it cost more still)
        x = mx.contiguous(qkv)  # the rows the commit reads again: copied once, not per launch
        n, s = qkv.shape[0], shape
        q, k, v, g, beta = self._launch(
            GDN_TREE_FRONT, shape, [x, a, b, conv_state, w.conv, w.A_log, w.dt_bias, tree.conv_taps],
            [((n, s.Hv, s.Dk), mx.float32), ((n, s.Hv, s.Dk), mx.float32), ((n, s.Hv, s.Dv), mx.float32),
             ((n, s.Hv), mx.float32), ((n, s.Hv), mx.float32)], 4, rows=n * s.Hv)
        rpg = self._rows_per_group(shape, max(1, min(4, SHARED_FLOATS // (levels * shape.Dk))))
        o, u = self._launch(GDN_TREE, shape, [q, k, v, g, beta, S0, tree.dfs_order, tree.depths],
                            [((n, s.Hv, s.Dv), mx.float32), ((n, s.Hv, s.Dv), mx.float32)], rpg, MAXD=levels)
        return o, TreeRows(x=x, k=k, u=u, g=g)

    # the commit runs inside the next verify's two kernels (SPR_FOLD builds): a round then builds
    # and launches no commit of its own, which on the H200 was ~0.7 ms a 17-node round, most of it
    # the host building and encoding 24 small launches (BENCHMARKS.md, issue 10)
    folds_commit = True

    def tree_after(self, shape, w, qkv, a, b, conv_state, S0, tree, fold):
        r = fold.rows
        if (not self.covers(shape) or tree.levels * shape.Dk > SHARED_FLOATS or qkv.dtype != conv_state.dtype
                or r.x.dtype != conv_state.dtype):
            return super().tree_after(shape, w, qkv, a, b, conv_state, S0, tree, fold)
        x = mx.contiguous(qkv)
        n, s = qkv.shape[0], shape
        q, k, v, g, beta, conv = self._launch(
            GDN_TREE_FRONT_FOLD, shape,
            [x, a, b, conv_state, w.conv, w.A_log, w.dt_bias, tree.conv_taps, r.x, fold.path],
            [((n, s.Hv, s.Dk), mx.float32), ((n, s.Hv, s.Dk), mx.float32), ((n, s.Hv, s.Dv), mx.float32),
             ((n, s.Hv), mx.float32), ((n, s.Hv), mx.float32), (tuple(conv_state.shape), conv_state.dtype)],
            4, rows=n * s.Hv)
        rpg = self._rows_per_group(shape, max(1, min(4, SHARED_FLOATS // (tree.levels * shape.Dk))))
        o, u, S = self._launch(
            GDN_TREE_FOLD, shape, [q, k, v, g, beta, S0, tree.dfs_order, tree.depths, r.k, r.u, r.g, fold.path],
            [((n, s.Hv, s.Dv), mx.float32), ((n, s.Hv, s.Dv), mx.float32), (tuple(S0.shape), mx.float32)],
            rpg, MAXD=tree.levels)
        return o, TreeRows(x=x, k=k, u=u, g=g), conv, S

    def commit(self, rows, path, conv_state, S0):
        if rows.x.dtype != conv_state.dtype or rows.k.shape[-1] % 32 or rows.k.shape[-1] > 256:
            return super().commit(rows, path, conv_state, S0)
        n, Hv, Dk = rows.k.shape
        K = conv_state.shape[0] + 1
        C = conv_state.shape[1]
        Dv = rows.u.shape[-1]
        Hk = (C - Hv * Dv) // (2 * Dk)
        shape = GDNShape(Hk, Hv, Dk, Dv, K)
        conv, S = self._launch(
            GDN_COMMIT, shape,
            [rows.x, rows.k, rows.u, rows.g, path, conv_state, S0],
            [(tuple(conv_state.shape), conv_state.dtype), (tuple(S0.shape), mx.float32)],
            self._rows_per_group(shape, 4))
        return conv, S


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
    return 1, max(1, min(4, steps))


MMA_LONG_STEPS = 64  # 8192 inputs at 4 bits
# Warps a block for long reductions. H200, 9B shape, one process, runs interleaved
# (scripts/bench_gpu.py --cores kernels-kw4,kernels-kw16): plain decode 179.0 tok/s with 16
# against 148.4 with 4 (faster in 5 of 5 paired runs), 17-node round 12.65 ms against 14.16;
# the down_proj's 96 steps at one row: 6 dependent steps a warp instead of 24.
MMA_LONG_KW = 16


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


def quantized_matmul_mma(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                         bits: int, config: tuple[int, int] | None = None, paired: bool | None = None, *,
                         norm: tuple[mx.array, float] | None = None, swiglu: bool = False,
                         res: mx.array | None = None) -> mx.array:
    """x [M, I] @ dequantize(w)^T on CUDA tensor cores (metal/qmm_mma.kernel), batch-invariant;
    the caller checks mma_covers. config: (RT, KW), for the micro-benchmark's sweep; paired:
    MMA_PAIRED_DEQUANT unless given (4-bit weights only). The fused builds, one launch each:
    norm (weight [I], eps): rms_norm(x) * weight first; swiglu: x is gate | up [M, 2 I], silu(gate)
    * up first; res [M, O]: res + the product (MLX's rounding of that add). norm and swiglu exclude
    each other."""
    assert norm is None or not swiglu, "one prologue: the norm or the SwiGLU"
    m, i = x.shape[0], x.shape[1] // (2 if swiglu else 1)
    o = w.shape[0]
    rt, kw = config or mma_config(o, i, bits)
    nt = -(-m // 8)
    blocks = -(-o // (16 * rt))
    dq = int(bits == 4 and (MMA_PAIRED_DEQUANT if paired is None else paired))
    template = [("OutT", x.dtype), ("GS", group_size), ("BITS", bits), ("NT", nt), ("RT", rt), ("KW", kw),
                ("DQ", dq)]
    spec, inputs = QMM_MMA, [x, w, scales, biases]
    if norm is not None:
        spec = QMM_MMA_NORM
        inputs += [norm[0], eps_array(norm[1])]
    elif swiglu:
        spec = QMM_MMA_SWIGLU if res is None else QMM_MMA_SWIGLU_RES
    if res is not None:
        assert spec is not QMM_MMA_NORM, "a norm build has no residual add"
        spec = QMM_MMA_RES if spec is QMM_MMA else spec
        inputs.append(res)
    return compiled_kernel(spec, "cuda")(
        inputs=inputs, template=template, grid=(blocks * kw * 32, 1, 1), threadgroup=(kw * 32, 1, 1),
        output_shapes=[(m, o)], output_dtypes=[x.dtype])[0]


@functools.cache
def eps_array(eps: float) -> mx.array:
    """A norm's epsilon as an array, made once (a kernel takes no float arguments); built from host
    data, it holds its value already, so a compiled layer's trace can capture it."""
    return mx.array([eps], dtype=mx.float32)


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


def quantized_linear(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int,
                     bits: int, mode: str = "affine", routed: bool = True) -> mx.array:
    """x [..., I] @ dequantize(w)^T for the model's quantized projections, where the loader routes
    them (`routed`): on CUDA qmm_mma where it covers the call, dequantize + GEMM from
    CUDA_DEQUANT_ROWS rows on; on the CPU dequantize + GEMM from CPU_DEQUANT_ROWS rows on; else
    (and unrouted) mx.quantized_matmul."""
    if routed:
        backend = gpu_backend()
        rows = x.reshape(-1, x.shape[-1])
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


def select_gdn_core() -> GDNCore:
    """OpsCore on the CPU; the kernels on CUDA; on Metal only when asked (see the module doc)."""
    choice = os.environ.get("SPRUCE_GDN_CORE", "auto")
    if choice not in ("auto", "ops", "kernels"):
        raise ValueError(f"SPRUCE_GDN_CORE must be auto, ops or kernels, got {choice!r}")
    backend = gpu_backend()
    if choice == "ops" or backend is None:
        return OpsCore()
    if choice == "kernels" or backend == "cuda":
        return KernelCore(backend)
    return OpsCore()


__all__ = ["GDNWeights", "KernelCore", "select_gdn_core"]
