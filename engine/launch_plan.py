"""Launch plans: a fixed sequence of the engine's CUDA kernels recorded once, then run as one MLX
operation per call (engine/cuda_ext.cpp).

Why: a 9B-shaped decode step on the GPU waits for the host, which pays for every MLX operation
(its Python call, its array, the scheduler's visit, its allocation, its launch's encoding): ~10 µs
a launching operation in a real step, a few for a view (BENCHMARKS.md, issue 13). A plan's call is
one operation whose evaluation adds the kernels' graph nodes directly.

How a plan is made: the code that launches the kernels runs once with `Buf` placeholders in place
of the per-call arrays, inside `record()`. Every kernel call it makes (engine/kernels.py `Kernel`)
is then handed to the recorder instead of MLX: its inputs are placeholders (regions of the
plan's inputs or of earlier launches' results) or arrays (weights, constants: captured, passed
to every call), its outputs new regions. So a plan's launches are the very launches the same code
makes with arrays: the same kernels, template arguments and grids (tests/kernels/test_launch_plan.py
holds the two equal bit for bit on the GPU).

Where results live: a region a caller asks for comes back as a fresh array each call (allocated
through MLX by one empty kernel's launch: MLX's CUDA allocator has no entry point outside libmlx);
every other region is scratch in a workspace the plan keeps. Every launch that touches the
workspace is declared to write it, so MLX orders them one after another across calls too.

Shapes and strides a kernel body reads (`x_shape`, `x_strides`, `x_ndim`) are passed as MLX passes
them, fixed at recording: placeholders are dense rows, and a column range of a placeholder exists
only where it has one row (`columns`), so its strides are those of its shape.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx

from engine import kernels
from engine.kernels import FastPath, KernelSpec, kernel_text

# A decode step's GDN layers as one plan each (engine/layer_plans.py, wired in by
# engine/models/qwen3_5.py), on by default on CUDA where the extension builds; SPRUCE_LAUNCH_PLANS=0
# (variant "-lp0") turns it off. With it the GDN layers of every pass but prefill run the wiring
# the plans record (the residual builds, the engine's own norm, gated norm and SwiGLU kernels), so
# that a verify's rows run the plan's kernels launch by launch. Measured on an H100 (BENCHMARKS.md,
# issue 13, forty-sixth session): plain decoding of the 9B-shaped 4-bit pair 1.15x and 1.34x faster
# in two runs, 2.39x and 2.38x mlx-lm against 2.19x and 1.85x without. The attention layers' two
# plans each are opt-in (engine/layer_plans.py ATTENTION): they cut the host's share of a step, but
# the step is bound by the device now and did not get shorter (forty-seventh session).
SWITCH = FastPath("SPRUCE_LAUNCH_PLANS", on=("cuda",))


def enabled() -> bool:
    """Whether the model is wired for plans: the switch on, CUDA, the extension built."""
    return SWITCH.enabled() and available()  # the extension is built on CUDA only


ALIGN = 256  # bytes: every workspace region starts on this boundary (vector loads, as MLX's allocator)

# the CUDA type each dtype is written as in a kernel's signature (MLX's dtype_to_cuda_type, with
# the fixed-width names spelled as the types they are on Linux: no header is needed for them)
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int",
              mx.uint32: "unsigned int", mx.int64: "long", mx.uint64: "unsigned long", mx.int16: "short",
              mx.uint16: "unsigned short", mx.int8: "signed char", mx.uint8: "unsigned char", mx.bool_: "bool"}


@dataclass(frozen=True)
class Buf:
    """A placeholder for an array while a plan records: `shape` dense rows of `dtype`, `offset`
    bytes into region `region` of the recorder. Takes what the kernels' wrappers ask of an array
    (shape, dtype, ndim, reshape)."""

    region: int
    offset: int
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.size

    def reshape(self, *shape: int | Sequence[int]) -> Buf:
        first = shape[0] if len(shape) == 1 else None
        dims: list[int] = list(first) if first is not None and not isinstance(first, int) else \
            [int(d) for d in shape]  # type: ignore[arg-type]
        if dims.count(-1) == 1:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = self.size // known if known else 0
        if math.prod(dims) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {tuple(dims)}")
        return Buf(self.region, self.offset, tuple(dims), self.dtype)


def columns(x: Any, start: int, stop: int) -> Any:
    """Columns [start, stop) of rows x [M, N]: a view of an array, or of a placeholder with one row
    (its columns are then contiguous)."""
    if not isinstance(x, Buf):
        return x[:, start:stop]
    if x.ndim != 2 or x.shape[0] != 1 or not 0 <= start <= stop <= x.shape[1]:
        raise ValueError(f"a placeholder's columns only of one row, got {x.shape}[:, {start}:{stop}]")
    return Buf(x.region, x.offset + start * x.dtype.size, (1, stop - start), x.dtype)


@dataclass(frozen=True)
class Source:
    """One kernel build as a whole translation unit, written as MLX's build_kernel writes
    mx.fast.cuda_kernel's (mlx/backend/cuda/custom_kernel.cpp): the header, a __global__ function
    in namespace mlx::core::cu whose parameters are the inputs then the outputs, the template
    arguments as constants, the body."""

    module: str
    kernel: str  # the name expression NVRTC resolves
    text: str
    infos: tuple[tuple[bool, bool, bool], ...]  # shape_infos: each input's shape, strides, ndim read


def shape_infos(spec: KernelSpec, body: str) -> list[tuple[bool, bool, bool]]:
    """Which of each input's shape, strides and ndim the body reads (MLX's test: the name's
    mention in the body), each then a parameter after the input's pointer."""
    return [(f"{n}_shape" in body, f"{n}_strides" in body, f"{n}_ndim" in body) for n in spec.inputs]


MAX_NDIM = 10  # mlx/backend/cuda/device/config.h: the length of a Shape or Strides parameter
# MLX's Shape and Strides parameters (mlx/backend/cuda/device/utils.cuh, not in the wheel): MAX_NDIM
# int32 / int64 by value, indexed
SHAPE_TYPES = ("struct Shape { int v[MAX_NDIM]; __device__ int operator[](int i) const { return v[i]; } };\n"
               "struct Strides { long v[MAX_NDIM]; __device__ long operator[](int i) const { return v[i]; } };\n")


def kernel_source(spec: KernelSpec, input_dtypes: Sequence[mx.Dtype], input_ndims: Sequence[int],
                  output_dtypes: Sequence[mx.Dtype], template: Sequence[tuple[str, Any]]) -> Source:
    header, body = kernel_text(spec, "cuda")
    infos = tuple(shape_infos(spec, body))
    constants = []
    for name, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {name} = {value};\n")
        else:
            constants.append(f"  using {name} = {CUDA_TYPES[value]};\n")
    params = []
    for n, d, ndim, (shape, strides, dims) in zip(spec.inputs, input_dtypes, input_ndims, infos, strict=True):
        params.append(f"    const {CUDA_TYPES[d]}* {n}")
        if ndim > 0:
            params += [f"    const __grid_constant__ Shape {n}_shape"] if shape else []
            params += [f"    const __grid_constant__ Strides {n}_strides"] if strides else []
            params += [f"    const __grid_constant__ int {n}_ndim"] if dims else []
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(spec.outputs, output_dtypes, strict=True)]
    key = repr((spec.name, [str(d) for d in input_dtypes], list(input_ndims), [str(d) for d in output_dtypes],
                [(n, str(v)) for n, v in template])).encode()
    name = f"spruce_plan_{spec.name}_{hashlib.sha256(key + header.encode() + body.encode()).hexdigest()[:16]}"
    text = (f"#include <cooperative_groups.h>\n#define MAX_NDIM {MAX_NDIM}\n" + SHAPE_TYPES + header
            + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + "".join(constants)
            + ("\n" if constants else "") + body + "\n}\n\n} // namespace mlx::core::cu\n")
    return Source(name, f"mlx::core::cu::{name}", text, infos)


def _dims_blob(values: Sequence[int], fmt: str) -> bytes:
    """A Shape (fmt "i") or Strides ("q") parameter's bytes: the values, zero-padded to MAX_NDIM."""
    if len(values) > MAX_NDIM:
        raise ValueError(f"more than {MAX_NDIM} dimensions")
    return struct.pack(f"<{MAX_NDIM}{fmt}", *values, *[0] * (MAX_NDIM - len(values)))


def dense_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


def nvrtc_options() -> list[str]:
    """The include paths MLX's JIT gives NVRTC (mlx/backend/cuda/jit_module.cpp): MLX's headers,
    CCCL's, and the CUDA runtime's headers from the nvidia package beside MLX's."""
    mlx_dir = Path(mx.__file__).parent
    paths = [mlx_dir / "include", mlx_dir / "include" / "cccl", mlx_dir.parent / "nvidia" / "cu13" / "include"]
    try:
        import nvidia

        paths += [Path(p) / "cu13" / "include" for p in nvidia.__path__]
    except ImportError:
        pass
    seen: list[str] = []
    for p in paths:
        if p.is_dir() and str(p) not in seen:
            seen.append(str(p))
    return [f"--include-path={p}" for p in seen]


@functools.cache
def _compiled(ext: ModuleType, source: Source) -> Any:
    major, minor = ext.compute_capability()
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return ext.compile_kernel(source.module, source.text, source.kernel, arch, nvrtc_options())


@dataclass
class _Region:
    nbytes: int
    kind: str  # "arg" (per call), "const" (captured array), "out" (a launch's result)
    array: mx.array | None = None
    slot: int = -1  # the plan's input this region is (args, consts, fresh outputs)
    offset: int = 0  # bytes into the workspace (scratch results)


@dataclass(frozen=True)
class _Launch:
    spec: KernelSpec
    source: Source
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    # (region, byte offset, written, b""), or (-1, 0, False, a by-value parameter's bytes)
    args: tuple[tuple[int, int, bool, bytes], ...]


@dataclass
class Recorder:
    """Collects a plan's launches: `arg` makes a per-call placeholder; kernel calls made inside
    `record()` are added in order."""

    name: str
    regions: list[_Region] = field(default_factory=list)
    launches: list[_Launch] = field(default_factory=list)
    args: list[Buf] = field(default_factory=list)
    _consts: dict[int, int] = field(default_factory=dict)  # id(array) -> region

    def arg(self, shape: Sequence[int], dtype: mx.Dtype) -> Buf:
        buf = Buf(len(self.regions), 0, tuple(shape), dtype)
        self.regions.append(_Region(buf.nbytes, "arg"))
        self.args.append(buf)
        return buf

    def _input(self, x: Any) -> tuple[Buf, mx.Dtype]:
        if isinstance(x, Buf):
            return x, x.dtype
        if not isinstance(x, mx.array):
            raise TypeError(f"a kernel input while recording must be a placeholder or an array, got {type(x)}")
        region = self._consts.get(id(x))
        if region is None:
            region = len(self.regions)
            self.regions.append(_Region(x.nbytes, "const", array=x))
            self._consts[id(x)] = region
        return Buf(region, 0, tuple(x.shape), x.dtype), x.dtype

    def __call__(self, spec: KernelSpec, backend: str, *, inputs: Sequence[Any], template: Sequence[tuple[str, Any]],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[mx.Dtype], **rest: Any) -> list[Buf]:
        if backend != "cuda" or rest:
            raise ValueError(f"{spec.name}: a launch plan records CUDA kernels with mx.fast's arguments only")
        ins = [self._input(x) for x in inputs]
        outs = []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            buf = Buf(len(self.regions), 0, tuple(shape), dtype)
            self.regions.append(_Region(buf.nbytes, "out"))
            outs.append(buf)
        source = kernel_source(spec, [d for _, d in ins], [b.ndim for b, _ in ins], list(output_dtypes), template)
        args: list[tuple[int, int, bool, bytes]] = []
        for (b, _), (reads_shape, reads_strides, reads_ndim) in zip(ins, source.infos, strict=True):
            args.append((b.region, b.offset, False, b""))
            if b.ndim > 0:
                # a placeholder's strides are its shape's (a one-row column range's first stride
                # differs from its array twin's, but only ever multiplies row 0)
                args += [(-1, 0, False, _dims_blob(b.shape, "i"))] if reads_shape else []
                args += [(-1, 0, False, _dims_blob(dense_strides(b.shape), "q"))] if reads_strides else []
                args += [(-1, 0, False, struct.pack("<i", b.ndim))] if reads_ndim else []
        args += [(b.region, 0, True, b"") for b in outs]
        self.launches.append(_Launch(spec, source, tuple(grid), tuple(threadgroup), tuple(args)))  # type: ignore[arg-type]
        return outs

    def build(self, results: Sequence[Buf], ext: ModuleType | None = None) -> LaunchPlan:
        """The plan whose calls return `results` (each a whole launch result, in a fresh array).
        ext: the CUDA extension (default: engine/cuda_ext.py's)."""
        ext = ext or _extension()
        fresh: list[Buf] = []
        for r in results:
            region = self.regions[r.region]
            if region.kind != "out" or r.offset != 0 or r.nbytes != region.nbytes or region.slot != -1:
                raise ValueError("a plan's result must be one launch's whole result, once")
            region.slot = -2  # marked; numbered below
            fresh.append(r)
        consts = [reg for reg in self.regions if reg.kind == "const"]
        slot = 0
        for reg in self.regions:
            if reg.kind == "arg":
                reg.slot, slot = slot, slot + 1
        for reg in consts:
            reg.slot, slot = slot, slot + 1
        workspace_slot, slot = slot, slot + 1
        for r in fresh:
            self.regions[r.region].slot, slot = slot, slot + 1
        used = 0
        for reg in self.regions:
            if reg.kind == "out" and reg.slot < 0:
                reg.slot, reg.offset = workspace_slot, used
                used += -(-reg.nbytes // ALIGN) * ALIGN
        launches = []
        for launch in self.launches:
            args = []
            for index, offset, written, blob in launch.args:
                if index < 0:
                    args.append((-1, 0, False, blob))
                    continue
                at = self.regions[index]
                in_workspace = at.slot == workspace_slot
                args.append((at.slot, at.offset + offset, written or in_workspace, b""))
            launches.append((_compiled(ext, launch.source), launch.grid, launch.threadgroup, 0, args))
        input_bytes = [0] * slot
        for reg in self.regions:
            if reg.slot != workspace_slot:
                input_bytes[reg.slot] = reg.nbytes
        input_bytes[workspace_slot] = used
        workspace = mx.zeros((max(1, -(-used // 4)),), dtype=mx.uint32)
        constants = [mx.contiguous(reg.array) for reg in consts if reg.array is not None]
        mx.eval(workspace, *constants)
        native = ext.make_plan(self.name, launches, input_bytes, [self.regions[r.region].slot for r in fresh])
        return LaunchPlan(self.name, ext, native, tuple((b.shape, b.dtype) for b in self.args), constants, workspace,
                          tuple((b.shape, b.dtype) for b in fresh), len(self.launches))


@contextmanager
def record(name: str) -> Iterator[Recorder]:
    """Records the kernel calls made inside the block into a new Recorder."""
    recorder = Recorder(name)
    kernels.RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        kernels.RECORDERS.remove(recorder)


@dataclass(frozen=True)
class LaunchPlan:
    """A recorded plan: call it with the arrays its placeholders stood for; returns its results."""

    name: str
    ext: ModuleType
    native: Any
    args: tuple[tuple[tuple[int, ...], mx.Dtype], ...]
    constants: list[mx.array]
    workspace: mx.array
    results: tuple[tuple[tuple[int, ...], mx.Dtype], ...]
    launches: int

    def accepts(self, *arrays: mx.array) -> bool:
        """Whether the arrays are what the plan was recorded for (shapes and dtypes)."""
        return len(arrays) == len(self.args) and all(
            a.shape == shape and a.dtype == dtype for a, (shape, dtype) in zip(arrays, self.args, strict=True))

    def __call__(self, *arrays: mx.array) -> list[mx.array]:
        if len(arrays) != len(self.args):
            raise ValueError(f"plan {self.name} takes {len(self.args)} arrays, got {len(arrays)}")
        for i, (a, (shape, dtype)) in enumerate(zip(arrays, self.args, strict=True)):
            if a.shape != shape or a.dtype != dtype:
                raise ValueError(f"plan {self.name}'s array {i}: {shape} {dtype} expected, got {a.shape} {a.dtype}")
        # the call's first array anchors the allocation: two calls in one compiled function then
        # differ in their inputs, so MLX's compile cannot merge them into one (and one buffer)
        fresh = _allocate(len(self.results))(
            inputs=[arrays[0]], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[s for s, _ in self.results],
            output_dtypes=[d for _, d in self.results])
        result: list[mx.array] = self.ext.run_plan(self.native, [*arrays, *self.constants, self.workspace, *fresh])
        return result


@functools.cache
def _allocate(n: int) -> Any:
    """A kernel that does nothing, with n outputs: MLX allocates them, uninitialised, on its stream.
    Its input is not read (nor copied: any layout)."""
    return mx.fast.cuda_kernel(name=f"spruce_plan_alloc{n}", input_names=["anchor"],
                               output_names=[f"out{i}" for i in range(n)], source="", ensure_row_contiguous=False)


def _extension() -> ModuleType:
    from engine import cuda_ext

    ext = cuda_ext.module()
    if ext is None:
        raise RuntimeError("launch plans need the engine's CUDA extension (engine/cuda_ext.py), not available here")
    return ext


def available() -> bool:
    from engine import cuda_ext

    return cuda_ext.module() is not None


def self_test(ext: ModuleType) -> bool:
    """Two add_norm launches, the second reading the first's results from the workspace, against
    the same two launches through MLX (engine/cuda_ext.py's check of a fresh build)."""
    from engine import fused_norms

    def two(x: Any, y: Any, w: mx.array) -> tuple[Any, Any]:
        h, n = fused_norms.add_norm(x, y, w, 1e-6, backend="cuda")
        return fused_norms.add_norm(h, n, w, 1e-6, backend="cuda")

    x, y = mx.random.normal((2, 1, 1, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    w = mx.random.normal((64,), key=mx.random.key(1)).astype(mx.bfloat16)
    with record("self-test") as rec:
        results = two(rec.arg(x.shape, x.dtype), rec.arg(y.shape, y.dtype), w)
    plan = rec.build(list(results), ext=ext)
    got = plan(x, y)
    want = two(x, y, w)
    mx.eval(*got, *want)
    return all(bool(mx.array_equal(g, t)) for g, t in zip(got, want, strict=True))
