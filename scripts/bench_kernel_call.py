"""What one custom-kernel call costs the host, by number of inputs (issue 10: the GDN commit's
evaluation took ~0.43 ms for 24 launches whose kernels ran ~0.23 ms; all layers in one launch with
145 inputs was slower still, so the cost seemed to grow with the arrays a call touches).

    python scripts/bench_kernel_call.py [--launches 24] [--inputs 1,4,8,16,32] [--runs 30]

On a GPU (MLX CUDA or Metal). For each input count n: `launches` independent calls of a kernel
that adds its n inputs (small arrays, or --elements), built eagerly or through mx.compile, then
evaluated; medians of --runs of host time to build the graph and to evaluate it, per launch.
Beside them: the same number of mx.add chains (n - 1 adds a launch) and an empty evaluation.
"""

from __future__ import annotations

import argparse
from typing import Any

import mlx.core as mx
from bench_op_costs import timed


def adder(n: int, backend: str) -> Any:
    names = [f"in{i}" for i in range(n)]
    if backend == "metal":
        body = ("uint i = thread_position_in_grid.x;\nif (i < in0_shape[0]) {\n  out[i] = "
                + " + ".join(f"{a}[i]" for a in names) + ";\n}\n")
        return mx.fast.metal_kernel(name=f"spr_add{n}", input_names=names, output_names=["out"], source=body)
    body = ("const int i = blockIdx.x * blockDim.x + threadIdx.x;\nif (i < in0_shape[0]) {\n  out[i] = "
            + " + ".join(f"{a}[i]" for a in names) + ";\n}\n")
    return mx.fast.cuda_kernel(name=f"spr_add{n}", input_names=names, output_names=["out"], source=body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=24)
    ap.add_argument("--inputs", default="1,2,4,8,16,32")
    ap.add_argument("--elements", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    backend = "metal" if mx.metal.is_available() else "cuda"
    print(f"device {mx.default_device()}, backend {backend}, mlx {mx.__version__}, {args.launches} launches, "
          f"{args.elements} float32 elements an input; ms for all launches (per launch in us)")
    L = args.launches
    empty = timed(lambda: [mx.array(1.0)], args.runs)[::2]  # (build, evaluation)
    print(f"empty evaluation: build {empty[0]:.3f} ms, eval {empty[1]:.3f} ms")
    print("| inputs | kernel eager: build / eval | kernel compiled: build / eval | mx.add chain eager: build / eval |")
    print("|---|---|---|---|")
    for n in (int(x) for x in args.inputs.split(",")):
        kern = adder(n, backend)
        data = [[mx.random.normal((args.elements,)) + i + j for i in range(n)] for j in range(L)]
        mx.eval(data)

        def launch(*xs: mx.array, kern: Any = kern) -> mx.array:
            return kern(inputs=list(xs), grid=(args.elements, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[(args.elements,)], output_dtypes=[mx.float32])[0]

        compiled = mx.compile(launch)

        def adds(*xs: mx.array) -> mx.array:
            out = xs[0]
            for x in xs[1:]:
                out = out + x
            return out

        rows = []
        for fn in (launch, compiled, adds):
            b, _, e = timed(lambda fn=fn, data=data: [fn(*data[j]) for j in range(L)], args.runs)
            rows.append(f"{b:.3f} / {e:.3f} ({1e3 * b / L:.1f} / {1e3 * e / L:.1f} us)")
        print(f"| {n} | " + " | ".join(rows) + " |", flush=True)


if __name__ == "__main__":
    main()
