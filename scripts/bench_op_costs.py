"""What one operation costs the host, by kind: building it into the lazy graph and evaluating it.

    python scripts/bench_op_costs.py [--ops 200] [--runs 20] [--dims 256] [--kinds add,linear3d,...]

A speculation round on the H200 was measured bound by the host, at ~10-13 us a launching
operation of the verify and the MTP draft (BENCHMARKS.md, issue 12, twenty-second session). This
says which kinds of operation that time is in, so that the launches or nodes that cost most are the
ones cut. Each kind is a chain of --ops operations on small tensors (the device's share is a few
microseconds a launch), each depending on the one before; medians of --runs of the time to build
the chain, to hand it to the device (the encoding, where the backend does it in mx.async_eval) and to
evaluate it in all, per operation. Views (reshape, transpose) launch nothing and are
here to show what a graph node costs without a launch. Runs on any backend; the GPU's numbers are
the ones that matter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.blas import reexec_with_openblas  # noqa: E402

if __name__ == "__main__":  # a BLAS preload works only from process start: before mlx is imported
    reexec_with_openblas(sys.orig_argv[1:])

import mlx.core as mx  # noqa: E402

from engine.kernels import gpu_backend  # noqa: E402
from engine.qmm import quantized_linear, quantized_matmul_mma  # noqa: E402

KINDS = ("empty", "reshape", "transpose", "add", "astype", "compiled3", "rms_norm", "matmul2d", "linear3d",
         "linear3d_compiled", "linear3d_rows17", "qlinear3d", "qlinear3d_rows17", "routed_qlinear3d",
         "routed_qlinear3d_rows17", "routed_qlinear3d_compiled", "qmm_mma2d", "slice_update", "custom_kernel",
         "custom_kernel_4in", "custom_kernel_7tmpl")


def chains(dims: int, dtype: mx.Dtype) -> dict[str, Callable[[mx.array, int], mx.array]]:
    """kind -> f(x [1, 1, dims], n) building n chained operations of that kind."""
    w = mx.random.normal((dims, dims)).astype(dtype) / dims**0.5
    norm_w = mx.ones((dims,), dtype)
    buf = mx.zeros((1, 4, 64, dims // 4), dtype)
    wq = mx.quantize(w, group_size=64, bits=4)
    mx.eval(w, norm_w, buf, wq)
    squash = mx.compile(lambda x: mx.sigmoid(x) * x + 1)
    linear = mx.compile(lambda x: x @ w.T)
    routed = mx.compile(lambda x: quantized_linear(x, *wq, group_size=64, bits=4))

    def repeat(step: Callable[[mx.array, int], mx.array]) -> Callable[[mx.array, int], mx.array]:
        def run(x: mx.array, n: int) -> mx.array:
            for i in range(n):
                x = step(x, i)
            return x
        return run

    def slice_update(x: mx.array, n: int) -> mx.array:
        b, row = buf, x.reshape(1, 4, 1, dims // 4)
        for i in range(n):  # a cache write at a position held on the device, as the MTP scratch does
            b = mx.slice_update(b, row, mx.array([i % 64]), axes=(2,))
        return b

    out: dict[str, Callable[[mx.array, int], mx.array]] = {
        "empty": lambda x, n: x,
        "reshape": repeat(lambda x, i: x.reshape(1, dims, 1) if i % 2 == 0 else x.reshape(1, 1, dims)),
        "transpose": repeat(lambda x, i: x.swapaxes(1, 2)),
        "add": repeat(lambda x, i: x + 1),
        "astype": repeat(lambda x, i: x.astype(mx.float32 if i % 2 == 0 else dtype)),
        "compiled3": repeat(lambda x, i: squash(x)),
        "rms_norm": repeat(lambda x, i: mx.fast.rms_norm(x, norm_w, 1e-6)),
        "matmul2d": lambda x, n: repeat(lambda y, i: y @ w)(x.reshape(1, dims), n),
        "linear3d": repeat(lambda x, i: x @ w.T),  # nn.Linear's form on [1, T, H] rows
        "linear3d_compiled": repeat(lambda x, i: linear(x)),
        # a verify's rows: M > 1 leaves the one-row (gemv) path
        "linear3d_rows17": lambda x, n: repeat(lambda y, i: y @ w.T)(mx.repeat(x, 17, axis=1), n),
        "qlinear3d": repeat(lambda x, i: mx.quantized_matmul(x, *wq, transpose=True, group_size=64, bits=4)),
        "qlinear3d_rows17": lambda x, n: repeat(lambda y, i: mx.quantized_matmul(
            y, *wq, transpose=True, group_size=64, bits=4))(mx.repeat(x, 17, axis=1), n),
        # the engine's quantized projection (qmm_mma on CUDA, a custom kernel)
        "routed_qlinear3d": repeat(lambda x, i: quantized_linear(x, *wq, group_size=64, bits=4)),
        "routed_qlinear3d_rows17": lambda x, n: repeat(
            lambda y, i: quantized_linear(y, *wq, group_size=64, bits=4))(mx.repeat(x, 17, axis=1), n),
        "routed_qlinear3d_compiled": repeat(lambda x, i: routed(x)),
        "slice_update": slice_update,
    }
    if gpu_backend() == "cuda":  # the tensor-core kernel called directly on [M, I] rows
        out["qmm_mma2d"] = lambda x, n: repeat(lambda y, i: quantized_matmul_mma(y, *wq, 64, 4))(x.reshape(1, dims), n)
    kernels = {n: copy_kernel(n) for n in (1, 4)}
    if kernels[1] is not None:  # what qmm_mma's call adds to a plain one: more inputs, template arguments
        def launch(x: mx.array, inputs: list[mx.array], template: list | None = None) -> mx.array:
            return kernels[len(inputs)](inputs=inputs, output_shapes=[x.shape], output_dtypes=[x.dtype],
                                        grid=(dims, 1, 1), threadgroup=(min(dims, 256), 1, 1),
                                        **({"template": template} if template else {}))[0]

        out["custom_kernel"] = repeat(lambda x, i: launch(x, [x]))
        out["custom_kernel_4in"] = repeat(lambda x, i: launch(x, [x, *wq]))
        tmpl = [("OutT", dtype), ("GS", 64), ("BITS", 4), ("NT", 1), ("RT", 1), ("KW", 4), ("DQ", 1)]
        out["custom_kernel_7tmpl"] = repeat(lambda x, i: launch(x, [x], tmpl))
    return out


def copy_kernel(inputs: int = 1):
    """A custom kernel that copies its first input and takes `inputs` in all (None on the CPU)."""
    if mx.default_device() == mx.cpu:
        return None
    names = ["x", *(f"in{i}" for i in range(1, inputs))]
    if mx.metal.is_available():
        body = "uint i = thread_position_in_grid.x;\nif (i < x_shape[2]) { y[i] = x[i]; }\n"
        return mx.fast.metal_kernel(name=f"spr_copy{inputs}", input_names=names, output_names=["y"], source=body)
    body = "const int i = blockIdx.x * blockDim.x + threadIdx.x;\nif (i < x_shape[2]) { y[i] = x[i]; }\n"
    return mx.fast.cuda_kernel(name=f"spr_copy{inputs}", input_names=names, output_names=["y"], source=body)


def timed(build: Callable[[], mx.array | list[mx.array]], runs: int) -> tuple[float, float, float]:
    """Median ms to build the graph, to hand it to the device (mx.async_eval's return: on a GPU the
    host's encoding of every launch) and to evaluate it in all (after three warm-ups)."""
    b, a, e = [], [], []
    for r in range(runs + 3):
        t0 = time.perf_counter()
        out = build()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.eval(out)
        t3 = time.perf_counter()
        if r >= 3:
            b.append(t1 - t0)
            a.append(t2 - t1)
            e.append(t3 - t1)
    return statistics.median(b) * 1e3, statistics.median(a) * 1e3, statistics.median(e) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--dims", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    x = mx.random.normal((1, 1, args.dims)).astype(dtype)
    mx.eval(x)
    available = chains(args.dims, dtype)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, {args.dtype}, chains of {args.ops}, "
          f"[1, 1, {args.dims}] rows; us an operation, medians of {args.runs}")
    print(f"{'kind':<26} {'build':>8} {'encode':>8} {'eval':>8} {'total':>8}")
    for kind in args.kinds.split(","):
        if kind not in available:
            print(f"{kind:<26} (not on this backend)")
            continue
        fn = available[kind]
        # one fresh input a run, so nothing is cached between runs
        build_ms, encode_ms, eval_ms = timed(lambda fn=fn: fn(x + 0, args.ops), args.runs)
        per = 1e3 / args.ops
        print(f"{kind:<26} {build_ms * per:8.2f} {encode_ms * per:8.2f} {eval_ms * per:8.2f} "
              f"{(build_ms + eval_ms) * per:8.2f}")


if __name__ == "__main__":
    main()
