"""GPU kernels: loads the sources in metal/ once, compiles them for the backend MLX runs on, and
picks the implementation of the GDN recurrent core. The quantized matmuls that launch these
kernels are chosen in engine/qmm.py.

Each kernel body in metal/ is written once. For Metal it is compiled by mx.fast.metal_kernel,
for CUDA by mx.fast.cuda_kernel, each with a small prelude (metal/prelude_*.h) that maps the
SPR_* names to the backend, plus a first line that names the thread indices (MLX declares the
Metal index attributes a body mentions, so the Metal names must appear in the body itself).

Which core runs (SPRUCE_GDN_CORE overrides: ops | kernels):
- CPU: CpuCore, the plain-MLX OpsCore with a token's step, a tree's verify and its commit each in
  one operation of the engine's own (engine/cpu_ext.cpp) where that is built.
- CUDA: the kernels, verified against their twins on an H200 (metal/README.md).
- Metal: OpsCore unless SPRUCE_GDN_CORE=kernels: the Metal build of the bodies has only been
  compile-checked against a stub here, never run on an Apple GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeGuard

import mlx.core as mx

from engine.gdn import ops
from engine.gdn.core import CpuCore, GDNCore, GDNShape, GDNWeights, OpsCore, TreeInputs, TreeRows, split_heads
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
# the step with the layer's output norm and gate (gated_norm.kernel's code) in the same launch
GDN_STEP_GATED = KernelSpec("spruce_gdn_step_gated", "gdn_step.kernel", (*GDN_STEP.inputs, "z", "nw", "eps"),
                            ("out", "conv_out", "state_out"), header=("gdn_common.h", "gated_head.h"),
                            defines=("SPR_GATED_OUT",))
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
# and the residual add after (engine.qmm.quantized_matmul_mma's norm, res, swiglu): launches a layer saves
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
# an MTP head's drafted row over its committed K/V and its draft's scratch (engine/models/mtp.py):
# the chunks, joined by ATTN_MERGE
ATTN_DRAFT = KernelSpec("spruce_attn_draft", "attn_rows.kernel", ("q", "keys", "values", "skeys", "svalues",
                                                             "length", "srow"),
                        ("part", "stats"), header=(), contiguous=False, defines=("SPR_ATTN_DRAFT",))
# a residual add and the RMS norm after it; the GDN output's norm and gate (engine/fused_norms.py)
ADD_NORM = KernelSpec("spruce_add_norm", "add_norm.kernel", ("x", "y", "w", "eps"), ("h", "out"), header=())
# the norm alone over rows [M, Hd], and the MLP's SwiGLU: the launch plans' own kernels for what the
# default wiring runs through MLX (engine/fused_norms.py rms_rows, swiglu)
RMS_NORM = KernelSpec("spruce_rms_norm", "add_norm.kernel", ("x", "w", "eps"), ("out",), header=(),
                      defines=("SPR_NORM_ONLY",))
SWIGLU = KernelSpec("spruce_swiglu", "swiglu.kernel", ("gu",), ("out",), header=())
# the gated-attention layer's launch-plan kernels (engine/layer_plans.py): its per-head q / k norms
# after the fused projection (with v and the gate copied out in the layouts the next steps read),
# and its output gate
HEAD_NORMS = KernelSpec("spruce_head_norms", "head_norms.kernel", ("y", "qw", "kw", "eps"), ("q", "k", "v", "gate"),
                        header=())
SIGMOID_GATE = KernelSpec("spruce_sigmoid_gate", "sigmoid_gate.kernel", ("a", "g"), ("out",), header=())
GATED_NORM = KernelSpec("spruce_gated_norm", "gated_norm.kernel", ("o", "z", "w", "eps"), ("out",),
                        header=("gated_head.h",), contiguous=False)
# each row's token (argmax, or the seeded draw under top-k / top-p / min-p) in one launch, and with
# SPR_TOP the raw logits' top-token probability (engine/choose_kernel.py)
CHOOSE = KernelSpec("spruce_choose", "choose.kernel", ("logits", "uniforms", "cuts"), ("tokens",),
                    header=("choose_cuda.h",), backends=("cuda",))
CHOOSE_TOP = KernelSpec("spruce_choose_top", "choose.kernel", (*CHOOSE.inputs, "raw"), ("tokens", "top"),
                        header=CHOOSE.header, backends=("cuda",), defines=("SPR_TOP",))
# a plain round's logit bias and penalties applied inside the launch (engine/device_penalties.py's
# steps), with and without the top probability
CHOOSE_PEN = KernelSpec("spruce_choose_pen", "choose.kernel", (*CHOOSE.inputs, "counts", "bias", "in_prompt", "pens"),
                        CHOOSE.outputs, header=CHOOSE.header, backends=("cuda",), defines=("SPR_PENALTIES",))
CHOOSE_TOP_PEN = KernelSpec("spruce_choose_top_pen", "choose.kernel", (*CHOOSE_TOP.inputs, *CHOOSE_PEN.inputs[3:]),
                            CHOOSE_TOP.outputs, header=CHOOSE.header, backends=("cuda",),
                            defines=("SPR_TOP", "SPR_PENALTIES"))
KERNELS = (GDN_STEP, GDN_STEP_GATED, GDN_CHAIN, GDN_TREE_FRONT, GDN_TREE, GDN_TREE_FRONT_FOLD, GDN_TREE_FOLD,
           GDN_COMMIT, QMM_ROWS, READ_FLOOR, READ_STREAM, QMM_MMA, QMM_MMA_NORM, QMM_MMA_RES, QMM_MMA_SWIGLU,
           QMM_MMA_SWIGLU_RES,
           ATTN_ROWS, ATTN_ONE, ATTN_MERGE, ATTN_DRAFT,
           ADD_NORM, RMS_NORM, SWIGLU, HEAD_NORMS, SIGMOID_GATE, GATED_NORM,
           CHOOSE, CHOOSE_TOP, CHOOSE_PEN, CHOOSE_TOP_PEN)


def read_source(file: str) -> str:
    return resources.files("metal").joinpath(file).read_text()


def kernel_text(spec: KernelSpec, backend: str) -> tuple[str, str]:
    """(header, body) of a kernel for a backend, as handed to MLX (compacted: compact_source)."""
    header = "".join(read_source(f) for f in (f"prelude_{backend}.h", *spec.header))
    defines = "".join(f"#define {name} 1\n" for name in spec.defines)
    return compact_source(header), compact_source(INDEX_NAMES[backend] + defines + read_source(spec.file))


# Launch plans being recorded (engine/launch_plan.py), innermost last: while one is, a kernel call
# is handed to it (its inputs are regions of the plan, not arrays) instead of being run by MLX.
RECORDERS: list[Callable[..., list[Any]]] = []


class Kernel:
    """A kernel as the engine calls it, with mx.fast's keyword arguments (inputs, template, grid,
    threadgroup, output_shapes, output_dtypes): run by MLX, or handed to the launch plan being
    recorded. MLX's kernel object is made at the first call MLX runs (each is a new library; and
    a plan can be recorded where MLX has no GPU backend)."""

    __slots__ = ("spec", "backend", "_mlx")

    def __init__(self, spec: KernelSpec, backend: str) -> None:
        self.spec, self.backend = spec, backend
        self._mlx: Any = None

    def __call__(self, **call: Any) -> list[Any]:
        if RECORDERS:
            return RECORDERS[-1](self.spec, self.backend, **call)
        if self._mlx is None:
            header, body = kernel_text(self.spec, self.backend)
            make = mx.fast.metal_kernel if self.backend == "metal" else mx.fast.cuda_kernel
            self._mlx = make(name=self.spec.name, input_names=list(self.spec.inputs),
                             output_names=list(self.spec.outputs), source=body, header=header,
                             ensure_row_contiguous=self.spec.contiguous)
        result: list[Any] = self._mlx(**call)
        return result


@functools.cache
def compiled_kernel(spec: KernelSpec, backend: str) -> Kernel:
    """The kernel, one object per process."""
    return Kernel(spec, backend)


@functools.cache
def eps_array(eps: float) -> mx.array:
    """A norm's epsilon as an array, made once (a kernel takes no float arguments); built from host
    data, it holds its value already, so a compiled layer's trace can capture it."""
    return mx.array([eps], dtype=mx.float32)


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


# A decode step's GDN core and its output norm + gate in one launch (KernelCore.step_gated), where
# the launch-plan wiring runs the gated norm kernel. Opt-in (SPRUCE_GATED_STEP=1, variant "-gs1"):
# on an H100 it is bitwise the two launches (tests/kernels/test_gdn_kernels.py -k gated_step, and in
# a lockstep CPU emulation, tests/kernels/test_kernel_emulation.py), but plain decoding of the
# 9B-shaped pair read 235.0 tok/s with it and without it (BENCHMARKS.md, issue 13, fiftieth
# session): one block a head puts the step on 32 SMs, which eats the launch it saves. Its ncu view
# is scripts/gpu_plans.sh's ncu stage (not run yet). GATED_STEP_WARPS: SIMD groups a head's
# threadgroup has (variant "-gwN"); 16 leaves a thread up to 128 registers, where 32 would cap it
# at 64.
GATED_STEP = FastPath("SPRUCE_GATED_STEP")
GATED_STEP_WARPS = 16


def gated_step_applies(core: GDNCore, shape: GDNShape, qkv: Any, conv_state: Any, z: Any,
                       norm_w: Any) -> TypeGuard[KernelCore]:
    """Whether a token's step runs with its gated norm in one launch (GATED_STEP, KernelCore.step_gated)."""
    return GATED_STEP.enabled() and isinstance(core, KernelCore) and core.step_gated_covers(shape, qkv, conv_state,
                                                                                            z, norm_w)


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
                **extra: int | mx.Dtype) -> list[mx.array]:
        """One SIMD group per row: `rows` of them (default: the state's Hv * Dv rows); `extra`: more
        template arguments."""
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
        # o is made [1, Hv, Dv] by the launch itself (the same buffer): an `o[None]` after it was
        # a graph node a layer for the host to evaluate
        o, conv, S = self._launch(
            GDN_STEP, shape, [qkv, a, b, conv_state, w.conv, w.A_log, w.dt_bias, S],
            [((1, shape.Hv, shape.Dv), mx.float32), (tuple(conv_state.shape), conv_state.dtype),
             (tuple(S.shape), mx.float32)], self._rows_per_group(shape, 4))
        return o, conv, S

    def step_gated_covers(self, shape: GDNShape, qkv: Any, conv_state: Any, z: Any, norm_w: Any) -> bool:
        """Whether step_gated takes this token: one row, z [1, Hv * Dv] of a float dtype. Arrays or
        launch-plan placeholders (shapes and dtypes only)."""
        return (self.covers(shape) and qkv.shape[0] == 1 and qkv.dtype == conv_state.dtype
                and tuple(z.shape) == (1, shape.Hv * shape.Dv) and z.dtype in (mx.bfloat16, mx.float16, mx.float32)
                and tuple(norm_w.shape) == (shape.Dv,))

    def step_gated(self, shape, w, qkv, a, b, conv_state, S, z, norm_w, eps: float):
        """The step and the layer's output norm and gate in one launch (GDN_STEP_GATED): -> (out
        [1, 1, Hv * Dv] in z's dtype, conv state, S), the bits of step() then
        fused_norms.gated_norm; the caller checks step_gated_covers."""
        s = shape
        rpg = self._rows_per_group(s, GATED_STEP_WARPS)
        # one threadgroup a head: Hv "rows" of rpg SIMD groups each
        return tuple(self._launch(
            GDN_STEP_GATED, s, [qkv, a, b, conv_state, w.conv, w.A_log, w.dt_bias, S, z, norm_w, eps_array(eps)],
            [((1, 1, s.Hv * s.Dv), z.dtype), (tuple(conv_state.shape), conv_state.dtype), (tuple(S.shape), mx.float32)],
            rpg, rows=s.Hv * rpg, OutT=z.dtype))

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


def select_gdn_core() -> GDNCore:
    """CpuCore on the CPU (OpsCore with the engine's own operations where they are built); the
    kernels on CUDA; on Metal only when asked (see the module doc)."""
    choice = os.environ.get("SPRUCE_GDN_CORE", "auto")
    if choice not in ("auto", "ops", "kernels"):
        raise ValueError(f"SPRUCE_GDN_CORE must be auto, ops or kernels, got {choice!r}")
    backend = gpu_backend()
    if choice == "ops":
        return OpsCore()
    if backend is None:
        return CpuCore()
    if choice == "kernels" or backend == "cuda":
        return KernelCore(backend)
    return OpsCore()


__all__ = ["GDNWeights", "KernelCore", "select_gdn_core"]
