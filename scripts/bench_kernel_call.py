"""What one custom-kernel call costs the host, by number of inputs (issue 10: the GDN commit's
evaluation took ~0.43 ms for 24 launches whose kernels ran ~0.23 ms; all layers in one launch with
145 inputs was slower still, so the cost seemed to grow with the arrays a call touches).

    python scripts/bench_kernel_call.py [--launches 24] [--inputs 1,4,8,16,32] [--runs 30]
        [--source-kb 0,4,16,64] [--qmm-repeats 4]

On a GPU (MLX CUDA or Metal). For each input count n: `launches` independent calls of a kernel
that adds its n inputs (small arrays, or --elements), built eagerly or through mx.compile, then
evaluated; medians of --runs of host time to build the graph and to evaluate it, per launch.
Beside them: the same number of mx.add chains (n - 1 adds a launch) and an empty evaluation.

Then what the length of a kernel's source costs (MLX's CUDA backend hashes the whole source at
every evaluation of a call: engine/kernel_source.py): the one-input kernel with a comment of
each --source-kb kilobytes in its header, and the engine's small-M matmul (qmm_mma, the 9B shape's
MLP down projection at one row, CUDA only) built from its sources as written and as compacted,
the two alternated --qmm-repeats times; host time to build and to hand over (mx.async_eval: the
encoding) per launch.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import mlx.core as mx
from bench_op_costs import timed

from engine import kernels, qmm


def adder(n: int, backend: str, header: str = "", tag: str = "") -> Any:
    names = [f"in{i}" for i in range(n)]
    if backend == "metal":
        body = ("uint i = thread_position_in_grid.x;\nif (i < in0_shape[0]) {\n  out[i] = "
                + " + ".join(f"{a}[i]" for a in names) + ";\n}\n")
        return mx.fast.metal_kernel(name=f"spr_add{n}{tag}", input_names=names, output_names=["out"], source=body,
                                    header=header)
    body = ("const int i = blockIdx.x * blockDim.x + threadIdx.x;\nif (i < in0_shape[0]) {\n  out[i] = "
            + " + ".join(f"{a}[i]" for a in names) + ";\n}\n")
    return mx.fast.cuda_kernel(name=f"spr_add{n}{tag}", input_names=names, output_names=["out"], source=body,
                               header=header)


def per_launch(build: Any, launches: int, runs: int) -> str:
    b, a, _ = timed(build, runs)
    return f"{1e3 * b / launches:.2f} / {1e3 * a / launches:.2f}"


def source_lengths(args: argparse.Namespace, backend: str) -> None:
    """The one-input kernel with a comment of k KB in its header, for each k."""
    L = args.launches
    data = [mx.random.normal((args.elements,)) + j for j in range(L)]
    mx.eval(data)
    print("\n| comment in the source | build / hand over, us a launch |\n|---|---|")
    for kb in (int(x) for x in args.source_kb.split(",") if x):
        line = "// " + "x" * 76 + "\n"
        kern = adder(1, backend, header=line * (kb * 1024 // len(line)), tag=f"_c{kb}")

        def build(kern: Any = kern) -> list[mx.array]:
            return [kern(inputs=[x], grid=(args.elements, 1, 1), threadgroup=(256, 1, 1),
                         output_shapes=[(args.elements,)], output_dtypes=[mx.float32])[0] for x in data]

        print(f"| {kb} KB | {per_launch(build, L, args.runs)} |", flush=True)


def qmm_text(args: argparse.Namespace) -> None:
    """qmm_mma from its sources as written and as compacted, alternated (CUDA only)."""
    L, o, i = args.launches, 4096, 12288
    w, scales, biases = mx.quantize(mx.random.normal((o, i)).astype(mx.bfloat16) * 0.02, group_size=64, bits=4)
    xs = [mx.random.normal((1, i)).astype(mx.bfloat16) for _ in range(L)]
    mx.eval(w, scales, biases, xs)
    compact = kernels.compact_source
    lengths, times = {}, {}
    for _ in range(args.qmm_repeats):
        for text in ("as written", "compacted"):
            kernels.compiled_kernel.cache_clear()  # a kernel object per text (MLX: one JIT module each)
            kernels.compact_source = compact if text == "compacted" else (lambda t: t)
            try:
                lengths[text] = sum(len(t) for t in kernels.kernel_text(kernels.QMM_MMA, "cuda"))
                qmm.quantized_matmul_mma(xs[0], w, scales, biases, 64, 4)  # compiled once, outside the timing
                b, a, _ = timed(lambda: [qmm.quantized_matmul_mma(x, w, scales, biases, 64, 4) for x in xs],
                                args.runs)
            finally:
                kernels.compact_source = compact
            times.setdefault(text, []).append((1e3 * b / L, 1e3 * a / L))
    kernels.compiled_kernel.cache_clear()
    print(f"\nqmm_mma, {o} x {i} 4-bit, one bf16 row, {L} launches an evaluation, {args.qmm_repeats} alternations")
    print("| source | characters | build / hand over, us a launch (median of the alternations) |\n|---|---|---|")
    for text, ts in times.items():
        print(f"| {text} | {lengths[text]} | {statistics.median(t[0] for t in ts):.2f} / "
              f"{statistics.median(t[1] for t in ts):.2f} ({', '.join(f'{t[1]:.2f}' for t in ts)}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=24)
    ap.add_argument("--inputs", default="1,2,4,8,16,32")
    ap.add_argument("--elements", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--source-kb", default="0,4,16,64", help="comment lengths for the source table ('' skips it)")
    ap.add_argument("--qmm-repeats", type=int, default=4, help="alternations of qmm_mma's texts (0 skips them)")
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
    source_lengths(args, backend)
    if backend == "cuda" and args.qmm_repeats:
        qmm_text(args)


if __name__ == "__main__":
    main()
