"""Runs a kernel body on the CPU: the CUDA text MLX would compile, built by g++, in one of two ways.

- `emulate`: SIMD groups of one lane (SPR_SIMD=1, so a SIMD sum is the lane's own value) and every
  thread of every group run one after another. Lanes only meet in SIMD sums, and each thread's
  threadgroup memory is its own slice, so this executes the bodies' real indexing and arithmetic;
  it cannot check the cross-lane part.
- `emulate_simt`: 32-lane warps in lockstep (tests/kernels/simt/simt.h: every thread of a block a
  fiber; shuffles, block barriers and the tensor-core MMA done by the lanes together), so the
  cross-lane part runs too, and the CUDA-only qmm_mma executes. Needs ucontext (Linux, glibc).
  Activations may be bf16 / fp16 there: pass their bits as uint16 arrays and name the type in
  `halves`.

The GPU run covers what neither can: the real hardware's scheduling and rounding
(tests/kernels/test_gdn_kernels.py, test_qmm.py)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np

from engine.kernels import KernelSpec
from tests.kernels.render import render_cuda

STUB = Path(__file__).resolve().parents[2] / "metal" / "stub"
SIMT = Path(__file__).resolve().parent / "simt"
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t", np.dtype(np.uint32): "uint32_t",
          np.dtype(np.bool_): "char", np.dtype(np.uint16): "uint16_t"}  # bool as bytes, passed as bool*
DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32", np.dtype(np.uint32): "uint32",
          np.dtype(np.bool_): "bool"}
HALF_CTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
# what the lockstep emulation needs: g++ and glibc's ucontext
SIMT_AVAILABLE = shutil.which("g++") is not None and platform.system() == "Linux"


def emulate(spec: KernelSpec, inputs: dict[str, np.ndarray], outputs: dict[str, tuple[tuple[int, ...], type]],
            template: dict[str, int | str], groups: int, threads: int, tmp: Path,
            views: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """Run `spec` over `groups` threadgroups of `threads` threads, one after another, with one-lane
    SIMD groups -> its outputs. views: inputs the kernel reads through their strides as a view of
    the given buffer (MLX hands a cache's slice so): name -> the view's shape, the leading part of
    the buffer along each axis."""
    return _run(spec, inputs, outputs, template, groups, threads, tmp, views or {}, {}, simt=False)


def emulate_simt(spec: KernelSpec, inputs: dict[str, np.ndarray], outputs: dict[str, tuple[tuple[int, ...], type]],
                 template: dict[str, int | str], groups: int, threads: int, tmp: Path,
                 views: dict[str, tuple[int, ...]] | None = None,
                 halves: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Run `spec` over `groups` blocks of `threads` threads with 32-lane warps in lockstep -> its
    outputs. halves: input or output name -> "bfloat16" | "float16" for arrays given (and
    returned) as uint16 bit patterns."""
    return _run(spec, inputs, outputs, template, groups, threads, tmp, views or {}, halves or {}, simt=True)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    return (b.astype(np.uint32) << 16).view(np.float32)


def _run(spec: KernelSpec, inputs: dict[str, np.ndarray], outputs: dict[str, tuple[tuple[int, ...], type]],
         template: dict[str, int | str], groups: int, threads: int, tmp: Path, views: dict[str, tuple[int, ...]],
         halves: dict[str, str], simt: bool) -> dict[str, np.ndarray]:
    arrays = {n: np.ascontiguousarray(inputs[n]) for n in spec.inputs}
    dtypes = {n: halves.get(n) or DTYPES[a.dtype] for n, a in arrays.items()}
    dtypes.update({n: halves.get(n) or DTYPES[np.dtype(t)] for n, (_, t) in outputs.items()})

    def ctype(name: str, dtype: np.dtype) -> str:
        return HALF_CTYPES[halves[name]] if name in halves else CTYPES[dtype]

    lines = ["dim3 blockIdx, threadIdx, blockDim, gridDim;"]
    for n, a in arrays.items():
        (tmp / f"in_{n}.bin").write_bytes(a.tobytes())
        lines.append(f"static std::vector<{ctype(n, a.dtype)}> {n}({a.size});")
    for n, (shape, t) in outputs.items():
        lines.append(f"static std::vector<{ctype(n, np.dtype(t))}> {n}({int(np.prod(shape))});")
    body = render_cuda(spec, dtypes, template, stub=True, include="simt.h" if simt else "cuda_stub.h")
    call = []
    for n in spec.inputs:
        call.append(f"reinterpret_cast<const bool*>({n}.data())" if arrays[n].dtype == np.bool_ else f"{n}.data()")
        shape = views.get(n, arrays[n].shape)
        if f"{n}_shape" in body:
            call.append("Shape{{" + ", ".join(str(d) for d in shape) + "}}")
        if f"{n}_strides" in body:
            strides = [st // arrays[n].itemsize for st in arrays[n].strides]
            call.append("Strides{{" + ", ".join(str(d) for d in strides) + "}}")
    call += [f"{n}.data()" for n in spec.outputs]
    lines.append(f"static void one_thread() {{ mlx::core::cu::custom_kernel_{spec.name}({', '.join(call)}); }}")
    lines.append("int main() {")
    for n, a in arrays.items():
        lines.append(f'  {{ FILE* f = fopen("{tmp}/in_{n}.bin", "rb"); '
                     f"if (fread({n}.data(), {a.itemsize}, {a.size}, f) != {a.size}) return 1; fclose(f); }}")
    if simt:
        lines.append(f"  simt::launch({groups}u, {threads}u, one_thread);")
    else:
        lines += [f"  gridDim = {{{groups}u, 1u, 1u}}; blockDim = {{{threads}u, 1u, 1u}};",
                  f"  for (unsigned emu_g = 0; emu_g < {groups}u; ++emu_g)",
                  f"    for (unsigned emu_t = 0; emu_t < {threads}u; ++emu_t) {{",
                  "      blockIdx = {emu_g, 0u, 0u}; threadIdx = {emu_t, 0u, 0u};", "      one_thread();", "    }"]
    for n in outputs:
        lines.append(f'  {{ FILE* f = fopen("{tmp}/out_{n}.bin", "wb"); fwrite({n}.data(), sizeof({n}[0]), '
                     f"{n}.size(), f); fclose(f); }}")
    lines += ["  return 0;", "}"]
    source = ("" if simt else "#define SPR_SIMD 1\n") + "#include <cstdio>\n#include <vector>\n" + body \
        + "\n".join(lines) + "\n"
    (tmp / "emulate.cpp").write_text(source)
    exe = tmp / "emulate"
    includes = [f"-I{SIMT}", f"-I{STUB}"] if simt else [f"-I{STUB}", f"-I{STUB / 'cuda'}"]
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-Wno-attributes", *includes, "-o", str(exe),
                            str(tmp / "emulate.cpp")], capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(build.stderr[-3000:])
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"the emulated kernel failed ({run.returncode}): {run.stderr[-2000:]}")
    return {n: np.fromfile(tmp / f"out_{n}.bin", dtype=t).reshape(shape) for n, (shape, t) in outputs.items()}
