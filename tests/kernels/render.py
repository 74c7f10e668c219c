"""The full source MLX builds from a kernel body, for each backend, to compile it outside MLX.

Mirrors mx.fast.metal_kernel's and mx.fast.cuda_kernel's source generation (the signature from
the input and output names and dtypes, template arguments, Metal index attributes named in the
body), so that g++ against metal/stub/ (CI) or nvcc against CUDA's headers (a machine that has
it) can check the exact text MLX would compile.
"""

from __future__ import annotations

from engine.kernels import KernelSpec, kernel_text

METAL_TYPES = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "half", "int32": "int32_t",
               "uint32": "uint32_t", "bool": "bool"}
CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int32": "int32_t",
              "uint32": "uint32_t", "bool": "bool"}
METAL_ATTRIBUTES = {
    "threadgroup_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threads_per_threadgroup": "uint3", "threadgroups_per_grid": "uint3",
    "thread_index_in_simdgroup": "uint", "simdgroup_index_in_threadgroup": "uint",
}


def render_metal(spec: KernelSpec, dtypes: dict[str, str], sizes: dict[str, int],
                 template: dict[str, int | str]) -> str:
    """dtypes: per input and output name; sizes: element counts of inputs (< 8 -> constant space).
    Ends with an explicit instantiation, so g++ checks the body with these template values."""
    header, body = kernel_text(spec, "metal")
    name = f"custom_kernel_{spec.name}"
    types, names = [], []
    for n in spec.inputs:
        types.append(f"const {'constant' if sizes.get(n, 8) < 8 else 'device'} {METAL_TYPES[dtypes[n]]}*")
        names.append(n)
        if f"{n}_shape" in body:
            types.append("const constant int*")
            names.append(f"{n}_shape")
        if f"{n}_strides" in body:
            types.append("const constant int64_t*")
            names.append(f"{n}_strides")
    types += [f"device {METAL_TYPES[dtypes[n]]}*" for n in spec.outputs]
    names += spec.outputs
    params = [f"  {t} {n} [[buffer({i})]]" for i, (t, n) in enumerate(zip(types, names))]
    attributes = [(a, t) for a, t in METAL_ATTRIBUTES.items() if a in body]
    params += [f"  {t} {a} [[{a}]]" for a, t in attributes]
    types += [t for _, t in attributes]
    targs = ", ".join(f"typename {k}" if isinstance(v, str) else f"int {k}" for k, v in template.items())
    tvals = ", ".join(METAL_TYPES[v] if isinstance(v, str) else str(v) for v in template.values())
    return (f"#include \"metal_stub.h\"\nusing namespace metal;\n{header}\ntemplate <{targs}>\n"
            f"[[kernel]] void {name}(\n" + ",\n".join(params) + f") {{\n{body}\n}}\n"
            f"template void {name}<{tvals}>({', '.join(types)});\n")


def render_cuda(spec: KernelSpec, dtypes: dict[str, str], template: dict[str, int | str], stub: bool,
                include: str = "cuda_stub.h") -> str:
    """include: the header standing in for CUDA where stub is True (metal/stub/'s for the g++
    check, tests/kernels/simt/'s for the lockstep emulation)."""
    header, body = kernel_text(spec, "cuda")
    params = []
    for n in spec.inputs:
        params.append(f"    const {CUDA_TYPES[dtypes[n]]}* {n}")
        if f"{n}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {n}_shape")
        if f"{n}_strides" in body:
            params.append(f"    const __grid_constant__ Strides {n}_strides")
    params += [f"    {CUDA_TYPES[dtypes[n]]}* {n}" for n in spec.outputs]
    consts = "".join(f"  using {k} = {CUDA_TYPES[v]};\n" if isinstance(v, str) else f"  constexpr int {k} = {v};\n"
                     for k, v in template.items())
    # MLX's own device header defines Shape; outside MLX a stand-in with the same use
    prefix = f"#include \"{include}\"\n" if stub else (
        "struct Shape {\n  int dims[8];\n  __device__ int operator[](int i) const { return dims[i]; }\n};\n"
        "struct Strides {\n  long long dims[8];\n"
        "  __device__ long long operator[](int i) const { return dims[i]; }\n};\n")
    return (f"{prefix}#include <cooperative_groups.h>\n{header}\nnamespace mlx::core::cu {{\n"
            "namespace cg = cooperative_groups;\n"
            f"__global__ void custom_kernel_{spec.name}(\n" + ",\n".join(params) + f") {{\n{consts}\n{body}\n}}\n"
            "}  // namespace mlx::core::cu\n")
