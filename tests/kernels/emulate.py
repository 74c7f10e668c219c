"""Runs a kernel body on the CPU: the CUDA text MLX would compile, built by g++ with SIMD groups of
one lane (SPR_SIMD=1, so a SIMD sum is the lane's own value) and every thread of every group run
one after another. Lanes only meet in SIMD sums, and each thread's threadgroup memory is its own
slice, so this executes the bodies' real indexing and arithmetic; what it cannot check is the
cross-lane part, which the GPU run covers (tests/kernels/test_gdn_kernels.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from engine.kernels import KernelSpec
from tests.kernels.render import render_cuda

STUB = Path(__file__).resolve().parents[2] / "metal" / "stub"
CTYPES = {np.dtype(np.float32): "float", np.dtype(np.int32): "int32_t", np.dtype(np.uint32): "uint32_t",
          np.dtype(np.bool_): "char"}  # bool stored as bytes (std::vector<bool> packs bits), passed as bool*
DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.int32): "int32", np.dtype(np.uint32): "uint32",
          np.dtype(np.bool_): "bool"}


def emulate(spec: KernelSpec, inputs: dict[str, np.ndarray], outputs: dict[str, tuple[tuple[int, ...], type]],
            template: dict[str, int | str], groups: int, threads: int, tmp: Path,
            views: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    """Run `spec` over `groups` threadgroups of `threads` threads -> its outputs. views: inputs the
    kernel reads through their strides as a view of the given buffer (MLX hands a cache's slice
    so): name -> the view's shape, the leading part of the buffer along each axis."""
    views = views or {}
    arrays = {n: np.ascontiguousarray(inputs[n]) for n in spec.inputs}
    dtypes = {n: DTYPES[a.dtype] for n, a in arrays.items()}
    dtypes.update({n: DTYPES[np.dtype(t)] for n, (_, t) in outputs.items()})
    lines = ["dim3 blockIdx, threadIdx, blockDim, gridDim;", "int main() {"]
    for n, a in arrays.items():
        (tmp / f"in_{n}.bin").write_bytes(a.tobytes())
        t = CTYPES[a.dtype]
        lines.append(f'  std::vector<{t}> {n}({a.size}); {{ FILE* f = fopen("{tmp}/in_{n}.bin", "rb"); '
                     f"if (fread({n}.data(), sizeof({t}), {a.size}, f) != {a.size}) return 1; fclose(f); }}")
    for n, (shape, t) in outputs.items():
        lines.append(f"  std::vector<{CTYPES[np.dtype(t)]}> {n}({int(np.prod(shape))});")
    body = render_cuda(spec, dtypes, template, stub=True)
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
    call_args = ", ".join(call)
    lines += [f"  gridDim = {{{groups}u, 1u, 1u}}; blockDim = {{{threads}u, 1u, 1u}};",
              f"  for (unsigned emu_g = 0; emu_g < {groups}u; ++emu_g)",
              f"    for (unsigned emu_t = 0; emu_t < {threads}u; ++emu_t) {{",
              "    blockIdx = {emu_g, 0u, 0u}; threadIdx = {emu_t, 0u, 0u};",
              f"    mlx::core::cu::custom_kernel_{spec.name}({call_args});", "  }"]
    for n in outputs:
        lines.append(f'  {{ FILE* f = fopen("{tmp}/out_{n}.bin", "wb"); fwrite({n}.data(), sizeof({n}[0]), '
                     f"{n}.size(), f); fclose(f); }}")
    lines += ["  return 0;", "}"]
    source = ("#define SPR_SIMD 1\n#include <cstdio>\n#include <vector>\n"
              + body + "\n".join(lines) + "\n")
    (tmp / "emulate.cpp").write_text(source)
    exe = tmp / "emulate"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-Wno-attributes", f"-I{STUB}", f"-I{STUB / 'cuda'}",
                            "-o", str(exe), str(tmp / "emulate.cpp")], capture_output=True, text=True)
    if build.returncode:
        raise RuntimeError(build.stderr[-3000:])
    subprocess.run([str(exe)], check=True)
    return {n: np.fromfile(tmp / f"out_{n}.bin", dtype=t).reshape(shape) for n, (shape, t) in outputs.items()}
